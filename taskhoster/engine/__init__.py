"""The engine: the one home of the item lifecycle (SPEC section 3) and its invariants.

Views, the socket consumer, the admin and the commands use only what this module exports, and
nothing else changes an item's state. Every change is an operation of a group commit
(``committer``, ``group``): many operations share one transaction and one flush of the item
files; a single call is a group of one.
"""

from .admission import backlog, overloaded
from .clocks import SweepReport, sweep
from .committer import execute, execute_async, hold_start, start_is_held
from .committer import start as start_committer
from .flow import Held, held_by_queue, held_for, next_due
from .flow import put_queue as upsert_queue
from .ops import (
    Claim,
    Claimed,
    Extend,
    Fail,
    NewItem,
    Op,
    Posted,
    Release,
    Requeue,
    Result,
    Verdict,
)
from .process import run_child
from .queues import (
    MAX_LIMIT,
    QUEUE_SETTINGS,
    WIRE_TO_FIELD,
    QueueSetting,
    clean_settings,
    queue_settings,
    validate_queue_name,
)
from .reading import (
    counts_by_queue,
    get_item,
    get_row,
    item_queue,
    list_items,
    live_queue_names,
    live_queues,
    store_root,
    wait_for_news,
    wait_for_verdict,
)
from .removal import QUEUE_DELETED, delete_by_status, delete_queue, reclaim_deleted_queues
from .repair import RepairReport, rebuild_threads, repair
from .rules import LEASE_EXPIRED, TIMEOUT, WORKER_DISCONNECTED, Clock, ItemRow
from .tally import OPENS
from .threads import (
    ThreadView,
    get_thread,
    list_threads,
    thread_head,
    thread_members,
    thread_position,
)
from .transitions import (
    admit_post,
    apply_clock,
    check_schedule,
    claim,
    delete_if_retained,
    delete_item,
    delete_items,
    extend,
    fail,
    get_live_queue,
    mark_fetched,
    post_items,
    post_items_soon,
    release_unsent,
    requeue_held,
    requeue_if_lapsed,
    restart,
    submit_result,
    time_out_if_aged,
)
from .wire import item_json, new_items

__all__ = [
    "LEASE_EXPIRED",
    "MAX_LIMIT",
    "OPENS",
    "QUEUE_DELETED",
    "QUEUE_SETTINGS",
    "TIMEOUT",
    "WIRE_TO_FIELD",
    "WORKER_DISCONNECTED",
    "Claim",
    "Claimed",
    "Clock",
    "Extend",
    "Fail",
    "Held",
    "ItemRow",
    "NewItem",
    "Op",
    "Posted",
    "QueueSetting",
    "Release",
    "RepairReport",
    "Requeue",
    "Result",
    "SweepReport",
    "ThreadView",
    "Verdict",
    "admit_post",
    "apply_clock",
    "backlog",
    "check_schedule",
    "claim",
    "clean_settings",
    "counts_by_queue",
    "delete_by_status",
    "delete_if_retained",
    "delete_item",
    "delete_items",
    "delete_queue",
    "execute",
    "execute_async",
    "extend",
    "fail",
    "get_item",
    "get_live_queue",
    "get_row",
    "get_thread",
    "held_by_queue",
    "held_for",
    "hold_start",
    "item_json",
    "item_queue",
    "list_items",
    "list_threads",
    "live_queue_names",
    "live_queues",
    "mark_fetched",
    "new_items",
    "next_due",
    "overloaded",
    "post_items",
    "post_items_soon",
    "queue_settings",
    "rebuild_threads",
    "reclaim_deleted_queues",
    "release_unsent",
    "repair",
    "requeue_held",
    "requeue_if_lapsed",
    "restart",
    "run_child",
    "start_committer",
    "start_is_held",
    "store_root",
    "submit_result",
    "sweep",
    "thread_head",
    "thread_members",
    "thread_position",
    "time_out_if_aged",
    "upsert_queue",
    "validate_queue_name",
    "wait_for_news",
    "wait_for_verdict",
]
