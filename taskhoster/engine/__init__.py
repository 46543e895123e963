"""The engine: the one home of the item lifecycle (SPEC section 3) and its invariants.

Views, the socket consumer, the admin and the commands translate their input into these calls
and nothing else changes an item's state.
"""

from .claiming import Claimed, claim, extend
from .clocks import SweepReport, sweep
from .posting import NewItem, Posted, get_live_queue, post_items, restart
from .queues import queue_settings, upsert_queue
from .reading import counts_by_queue, get_item, list_items, wait_for_verdict
from .removal import delete_by_status, delete_item, delete_items, delete_queue
from .repair import RepairReport, rebuild_threads, repair
from .verdicts import (
    LEASE_EXPIRED,
    TIMEOUT,
    WORKER_DISCONNECTED,
    Verdict,
    fail,
    release_unsent,
    requeue_held,
    requeue_if_lapsed,
    submit_result,
    time_out_if_aged,
)

__all__ = [
    "LEASE_EXPIRED",
    "TIMEOUT",
    "WORKER_DISCONNECTED",
    "Claimed",
    "NewItem",
    "Posted",
    "RepairReport",
    "SweepReport",
    "Verdict",
    "claim",
    "counts_by_queue",
    "delete_by_status",
    "delete_item",
    "delete_items",
    "delete_queue",
    "extend",
    "fail",
    "get_item",
    "get_live_queue",
    "list_items",
    "post_items",
    "queue_settings",
    "rebuild_threads",
    "release_unsent",
    "repair",
    "requeue_held",
    "requeue_if_lapsed",
    "restart",
    "submit_result",
    "sweep",
    "time_out_if_aged",
    "upsert_queue",
    "wait_for_verdict",
]
