"""Post items, read them and wait for their verdicts from code in the same Django project (a
view, a signal handler, a management command): the engine's calls, without HTTP.

    from django.db import transaction
    from taskhoster import local

    with transaction.atomic():
        order = Order.objects.create(...)
        posting = local.post("emails", {"order": order.pk})  # posted when this commits
    item = local.wait(posting.id, timeout=30)               # the REST API's item JSON

- **Validation and errors are the REST API's.** The same contract (``taskhoster.contract``),
  the same limits, the same exceptions (``taskhoster.errors``) with the code and message the
  REST API would answer with: ``InvalidInput`` (400), ``TooLarge`` (413), ``QueueNotFound`` /
  ``ItemNotFound`` (404), ``Conflict`` (409). No API key or scope applies: the caller is the
  project's own code.
- **A post inside a transaction is made when it commits**, through ``transaction.on_commit``,
  and never if it (or the savepoint the post was made in) rolls back. So a worker cannot get
  an item before the rows it refers to are committed. Outside a transaction the item is
  posted, its file on disk, when ``post`` returns.
- **Items are the REST API's wire JSON** (``engine.item_json``: ``id``, ``status``,
  ``threadId``, ...).

The whole story, with the window a crash can still hit: ``docs/in-project.md``.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterable
from datetime import datetime, timedelta
from functools import partial
from typing import Any, NoReturn, Unpack

from asgiref.sync import sync_to_async
from django.db import DEFAULT_DB_ALIAS, connections, transaction
from django.db.transaction import TransactionManagementError

from . import contract, engine
from .api import params
from .client.models import ItemOptionFields, ItemOptions, NewItem
from .conf import get_conf
from .errors import InvalidInput
from .timeutil import now as utcnow

__all__ = [
    "ItemOptions",
    "NewItem",
    "NotPosted",
    "Posting",
    "get",
    "get_async",
    "post",
    "post_async",
    "post_many",
    "post_many_async",
    "wait",
    "wait_async",
]

log = logging.getLogger(__name__)

Item = dict[str, Any]


class NotPosted(RuntimeError):
    """The post waits for its transaction to commit: its item is not known yet (and never
    will be, if the transaction rolls back)."""


class Posting:
    """An item a post asked for.

    Outside a transaction it is posted when :func:`post` returns. Inside one (``deferred``)
    it is posted when the transaction commits; until then ``posted`` is False and ``item``,
    ``id`` and ``created`` raise :class:`NotPosted`; if the transaction rolls back it stays
    so. If a deferred post fails at the commit, ``error`` holds the exception and ``item``,
    ``id`` and ``created`` raise it.
    """

    __slots__ = ("_created", "_item", "deferred", "error", "queue")

    def __init__(self, queue: str) -> None:
        self.queue = queue
        self.deferred = False
        self.error: Exception | None = None
        self._item: Item | None = None
        self._created = False

    @property
    def posted(self) -> bool:
        return self._item is not None

    @property
    def item(self) -> Item:
        """The item as the post answered it (REST's wire JSON: a key's finished item with its
        ``result``)."""
        if self._item is None:
            if self.error is not None:
                raise self.error
            raise NotPosted(
                f"this post to {self.queue!r} waits for its transaction to commit: its item "
                "is known after the commit (and never, if the transaction rolls back)"
            )
        return self._item

    @property
    def id(self) -> str:
        return str(self.item["id"])

    @property
    def created(self) -> bool:
        """False when the post found a live item of the same ``key`` (that item is ``item``)."""
        self.item  # noqa: B018 (raises when not posted)
        return self._created

    def __repr__(self) -> str:
        if self._item is not None:
            state = f"posted id={self._item['id']!r}"
        elif self.error is not None:
            state = f"failed {self.error!r}"
        else:
            state = "waiting for the commit"
        return f"<Posting {self.queue!r} {state}>"


# -- posting ---------------------------------------------------------------------------------


def post(
    queue: str,
    payload: Any,
    *,
    options: ItemOptions | None = None,
    using: str | None = None,
    robust: bool = False,
    **fields: Unpack[ItemOptionFields],
) -> Posting:
    """Post one item to ``queue``, now, or when the open transaction commits.

    Its options are ``options`` (an :class:`ItemOptions`) or their fields as keywords
    (``thread_id=``, ``delay=``, ``scheduled_at=``, ``key=``, ``priority=``; a keyword wins
    over ``options``). ``priority`` (0-9, default 0): a queue hands out its higher priorities
    first. ``delay`` (seconds or a timedelta, counted from the moment the item is
    posted) and ``scheduled_at`` (an aware datetime, or a wire time such as
    ``2026-01-31T12:00:00Z``) are exclusive. With a ``key`` whose item is still live in the
    queue, that item is the answer (``created`` is False).

    The post waits for the transaction open on the connection ``using`` (the default
    database when None) and for one open on Taskhoster's own (``default``). A bad value
    raises at once, in a transaction too. A deferred post that fails at the commit (its
    queue deleted meanwhile, the store unavailable) raises out of the ``atomic`` block that
    committed, after its commit; with ``robust=True`` it is logged instead (logger
    ``taskhoster.local``) and kept on ``Posting.error``.
    """
    body = _body(payload, ItemOptions.given(options, fields), where="")
    return _post(queue, [body], batch=False, using=using, robust=robust)[0]


def post_many(
    queue: str, items: Iterable[Any], *, using: str | None = None, robust: bool = False
) -> list[Posting]:
    """Post several items (bare payloads, or :class:`NewItem` for options) all or none, in
    order: at most ``MAX_BATCH`` (1000) and at least one, as ``{"items": [...]}`` over REST.
    Now, or when the open transaction commits, as :func:`post`."""
    bodies = [
        _body(new.payload, new, where=f"items[{n}].")
        for n, new in enumerate(map(NewItem.of, items))
    ]
    return _post(queue, bodies, batch=True, using=using, robust=robust)


def _body(payload: Any, options: ItemOptions, *, where: str) -> dict[str, Any]:
    """The REST body of the item (``ItemOptions.wire``: the other values as they were given),
    so that the contract judges exactly what a REST post would send."""
    # The payload as JSON reads it back: what is validated is what is posted, whatever the
    # caller does with its objects before a deferred post's commit.
    copy = _json_copy(payload, f"{where}payload")
    at = options.scheduled_at
    if isinstance(at, datetime) and (at.tzinfo is None or at.utcoffset() is None):
        raise InvalidInput(
            f"{where}scheduledAt must be an aware datetime (a naive one names no moment)",
            code="invalid",
        )
    return options.wire(copy)


def _json_copy(value: Any, name: str) -> Any:
    """``value`` as JSON reads it back, refused unless it is only what a JSON body can hold
    (dicts with string keys, lists, strings, finite numbers, booleans and None), so the item
    reads back as it was posted.

    A round trip through JSON (in C) tells, and its result is the copy; a walk through the
    value (slower) says where a refused value is.
    """
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False)
        copy = json.loads(text)
        if copy == value:
            text.encode("utf-8")  # a lone surrogate is no text to store
            contract.check_depth(text, copy)  # as REST and the socket do
            return copy
    except (TypeError, ValueError, UnicodeEncodeError):
        pass
    except RecursionError:
        _too_deep()
    try:
        _walk_json(value, [name])
    except RecursionError:
        _too_deep()
    raise InvalidInput(f"{name} does not read back from JSON as it is", code="invalid")


def _too_deep() -> NoReturn:
    most = get_conf().max_json_depth
    raise InvalidInput(f"the JSON is nested more than {most} levels deep", code="too_deep")


def _walk_json(value: Any, path: list[str]) -> None:
    """``path`` is where ``value`` is, in pieces, joined only to name a refused value."""
    if value is None or isinstance(value, bool | int):
        return
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidInput(
                f"{''.join(path)} holds a lone surrogate: not text", code="invalid"
            ) from None
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidInput(f"{''.join(path)} must be finite", code="invalid")
        return
    if isinstance(value, list):
        for n, member in enumerate(value):
            path.append(f"[{n}]")
            _walk_json(member, path)
            path.pop()
        return
    if isinstance(value, dict):
        for field, member in value.items():
            if not isinstance(field, str):
                raise InvalidInput(
                    f"{''.join(path)} has the key {field!r}: JSON keys are strings",
                    code="invalid",
                )
            path.append(" key")
            _walk_json(field, path)
            path[-1] = f"[{json.dumps(field, ensure_ascii=False)}]"
            _walk_json(member, path)
            path.pop()
        return
    raise InvalidInput(
        f"{''.join(path)} is a {type(value).__name__}: JSON has dicts, lists, strings, "
        "numbers, booleans and None",
        code="invalid",
    )


def _post(
    queue: str, bodies: list[dict[str, Any]], *, batch: bool, using: str | None, robust: bool
) -> list[Posting]:
    engine.validate_queue_name(queue)
    new = engine.new_items({"items": bodies} if batch else bodies[0])
    postings = [Posting(queue) for _ in new]
    # The caller's alias first, then Taskhoster's own: an engine call made inside a
    # transaction on ``default`` would run in it (``engine.execute``), and a
    # rollback would then take its row but leave its file.
    aliases = list(dict.fromkeys([using or DEFAULT_DB_ALIAS, DEFAULT_DB_ALIAS]))
    deferred = _in_transaction(aliases)
    if deferred:
        _check_early(queue, new)
        for posting in postings:
            posting.deferred = True
    _when_committed(aliases, partial(_run, queue, new, postings, robust=deferred and robust))
    return postings


def _in_transaction(aliases: list[str]) -> bool:
    for alias in aliases:
        connection = connections[alias]
        if connection.in_atomic_block:
            return True
        if not connection.get_autocommit():
            raise TransactionManagementError(
                f"a transaction managed by hand is open on {alias!r}: taskhoster.local posts "
                "after a commit only inside transaction.atomic()"
            )
    return False


def _when_committed(aliases: list[str], run: Callable[[], None]) -> None:
    """``run()`` now, or once every transaction open on ``aliases`` has committed.

    Each alias is waited for once: when its hook runs, the alias is done with (under
    ``captureOnCommitCallbacks(execute=True)`` its test transaction is still open; asking
    again would register the hook forever).
    """
    for n, alias in enumerate(aliases):
        if connections[alias].in_atomic_block:
            transaction.on_commit(partial(_when_committed, aliases[n + 1 :], run), using=alias)
            return
    run()


def _check_early(queue: str, new: list[engine.NewItem]) -> None:
    """What the engine would refuse at the commit and can be told now, so that a deferred
    post fails at the call: a queue that does not exist, a time past the queue timeout. The
    engine decides again at the commit."""
    live = engine.get_live_queue(queue)
    at = utcnow()
    for item in new:
        scheduled = item.scheduled_at or at
        if item.delay_seconds is not None:
            scheduled = at + timedelta(seconds=item.delay_seconds)
        engine.check_schedule(scheduled, at, live.queue_seconds)


def _run(queue: str, new: list[engine.NewItem], postings: list[Posting], *, robust: bool) -> None:
    try:
        posted = engine.post_items(queue_name=queue, items=new)
    except Exception as exc:
        for posting in postings:
            posting.error = exc
        if not robust:
            raise
        log.error(
            "a post of %d item(s) to queue %r, made when its transaction committed, failed: "
            "%s (keys: %s)",
            len(new),
            queue,
            exc,
            [item.key for item in new],
            exc_info=exc,
        )
        return
    for posting, done in zip(postings, posted, strict=True):
        posting._item = engine.item_json(done.row, payload=done.payload, result=done.result)
        posting._created = done.created


# -- reading ---------------------------------------------------------------------------------


def get(item_id: str) -> Item:
    """The item as ``GET /api/items/{id}`` answers it (a finished item with its ``result``).

    As there, reading a finished or failed item starts its ``retainFrom: "fetched"``
    retention clock. Raises ``InvalidInput`` (``invalid_id``) or ``ItemNotFound``; and
    ``StoreError`` for an item whose file a failed flush left, while that file cannot be
    written again, or at once inside a transaction (``engine.reading.durable_row``).
    """
    params.item_id(item_id)
    row, record = engine.get_item(item_id=item_id, producer_read=True)
    return engine.item_json(row, payload=record.get("payload"), result=record.get("result"))


def wait(item_id: str, timeout: float | timedelta) -> Item:
    """The item once it is finished or failed, or as it is after ``timeout`` seconds (check
    its ``status``): ``GET /api/items/{id}?wait=...`` without the 60 s limit.

    It wakes at once for a verdict committed in this process, and within
    ``LONG_POLL_INTERVAL`` for one committed anywhere else. Not inside a transaction on
    Taskhoster's database: it would hold the transaction open (on SQLite, hold the write
    lock the verdict needs) for the whole wait; that raises ``TransactionManagementError``.
    """
    params.item_id(item_id)
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, int | float)
        or not math.isfinite(seconds)
        or seconds < 0
    ):
        raise InvalidInput(
            "timeout must be a finite number of seconds, 0 or more", code="invalid_wait"
        )
    if connections[DEFAULT_DB_ALIAS].in_atomic_block:
        raise TransactionManagementError(
            "taskhoster.local.wait() inside a transaction would hold it open for the whole "
            "wait; wait after the commit"
        )
    engine.wait_for_verdict(item_id=item_id, wait=float(seconds))
    return get(item_id)


# -- the same on an event loop ---------------------------------------------------------------


async def post_async(
    queue: str,
    payload: Any,
    *,
    options: ItemOptions | None = None,
    using: str | None = None,
    robust: bool = False,
    **fields: Unpack[ItemOptionFields],
) -> Posting:
    """:func:`post` for async code (run in Django's thread for sync calls)."""
    options = ItemOptions.given(options, fields)
    call = partial(post, queue, payload, options=options, using=using, robust=robust)
    answer: Posting = await sync_to_async(call)()
    return answer


async def post_many_async(
    queue: str, items: Iterable[Any], *, using: str | None = None, robust: bool = False
) -> list[Posting]:
    """:func:`post_many` for async code."""
    answer: list[Posting] = await sync_to_async(post_many)(
        queue, list(items), using=using, robust=robust
    )
    return answer


async def get_async(item_id: str) -> Item:
    """:func:`get` for async code."""
    answer: Item = await sync_to_async(get)(item_id)
    return answer


async def wait_async(item_id: str, timeout: float | timedelta) -> Item:
    """:func:`wait` for async code: the wait holds a thread of its own, not Django's thread
    for sync calls (which every other ``sync_to_async`` call of the loop shares)."""
    answer: Item = await sync_to_async(_wait_and_close, thread_sensitive=False)(item_id, timeout)
    return answer


def _wait_and_close(item_id: str, timeout: float | timedelta) -> Item:
    try:
        return wait(item_id, timeout)
    finally:
        # A thread of the loop's executor: nothing closes its connection otherwise.
        connections.close_all()
