"""The engine: the one home of the item lifecycle (SPEC section 3) and its invariants.

Views, the socket consumer, the admin and the commands use only what this module exports, and
nothing else changes an item's state. Every change is an operation of a group commit
(``committer``, ``group``): many operations share one transaction and one flush of the item
files; a single call is a group of one.
"""

from . import queues, threads
from .clocks import SweepReport, sweep
from .group import LEASE_EXPIRED, TIMEOUT, WORKER_DISCONNECTED, check_schedule
from .ops import Claimed, NewItem, Posted, Verdict
from .queues import queue_settings, upsert_queue
from .reading import (
    counts_by_queue,
    get_item,
    get_row,
    list_items,
    wait_for_news,
    wait_for_verdict,
)
from .removal import QUEUE_DELETED, delete_by_status, delete_queue, reclaim_deleted_queues
from .repair import RepairReport, rebuild_threads, repair
from .rows import ItemRow, first_pending_member, next_due
from .transitions import (
    admit_post,
    apply_clock,
    claim,
    claim_async,
    claim_seen_async,
    delete_if_retained,
    delete_item,
    delete_items,
    extend,
    extend_async,
    fail,
    fail_async,
    get_live_queue,
    mark_fetched,
    post_items,
    post_items_soon,
    release_unsent,
    release_unsent_async,
    requeue_held,
    requeue_held_async,
    requeue_if_lapsed,
    restart,
    submit_result,
    submit_result_async,
    time_out_if_aged,
)
from .wire import item_json, new_items

__all__ = [
    "LEASE_EXPIRED",
    "QUEUE_DELETED",
    "TIMEOUT",
    "WORKER_DISCONNECTED",
    "Claimed",
    "ItemRow",
    "NewItem",
    "Posted",
    "RepairReport",
    "SweepReport",
    "Verdict",
    "admit_post",
    "apply_clock",
    "check_schedule",
    "claim",
    "claim_async",
    "claim_seen_async",
    "counts_by_queue",
    "delete_by_status",
    "delete_if_retained",
    "delete_item",
    "delete_items",
    "delete_queue",
    "extend",
    "extend_async",
    "fail",
    "fail_async",
    "first_pending_member",
    "get_item",
    "get_live_queue",
    "get_row",
    "item_json",
    "list_items",
    "mark_fetched",
    "new_items",
    "next_due",
    "post_items",
    "post_items_soon",
    "queue_settings",
    "queues",
    "rebuild_threads",
    "reclaim_deleted_queues",
    "release_unsent",
    "release_unsent_async",
    "repair",
    "requeue_held",
    "requeue_held_async",
    "requeue_if_lapsed",
    "restart",
    "submit_result",
    "submit_result_async",
    "sweep",
    "threads",
    "time_out_if_aged",
    "upsert_queue",
    "wait_for_news",
    "wait_for_verdict",
]
