"""Invariant I8 over a real daphne: "Every malformed, oversized or unauthorised request gets a
4xx JSON error and changes nothing; ... nothing answers 500" (SPEC section 4).

``test_api_bad_input.py`` proves it case by case through Django's test client, which runs
every request in a thread. In production a post of items is answered on daphne's event loop
(``taskhoster.asgi``), and everything goes through daphne's own request parsing. Here the same
cases (the lists of that module, and the values of its parametrized tests, read from their
marks, so a case added there is run here too) are sent over HTTP to a real daphne, with the
path sent byte for byte as written (no client-side normalisation of ``..`` or escapes), and
each must get a 4xx JSON error of the contract's shape, never a 500, and leave the index
rows, the keys, the state directories and what is around them exactly as they were.

One daphne and one world serve each family of cases; a case that changed something is
reported by name, and the next is compared with the world as that case left it, so one
failure does not hide or fake the others.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, cast

import httpx
import pytest

from taskhoster import health
from taskhoster.models import ApiKey, Item, Queue, Thread

from . import test_api_bad_input as cases
from .test_api_bad_input import (
    BAD_ITEM_IDS,
    BAD_QUEUE_NAMES,
    BODY_ENDPOINTS,
    ITEM_ENDPOINTS,
    LONE_SURROGATES,
    MALFORMED,
    MISSING_FIELDS,
    NON_FINITE,
    NON_OBJECTS,
    OUT_OF_RANGE,
    QUEUE_ENDPOINTS,
    UNKNOWN_FIELDS,
    WRONG_TYPES,
    World,
    build_world,
    snapshot,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# What a running server changes by itself: its log beside the state root, and the file its
# health monitor writes and removes in the state root every few seconds (``health``).
SERVER_LOG = re.compile(r"^daphne-\d+\.log$")
HEALTH_PROBE = health.PROBE_NAME


def parametrized(test: Any, argnames: str) -> list[Any]:
    """The values a test of ``test_api_bad_input`` is parametrized with for ``argnames``."""
    wanted = [name.strip() for name in argnames.split(",")]
    for mark in getattr(test, "pytestmark", []):
        if mark.name != "parametrize":
            continue
        names = mark.args[0]
        names = names.split(",") if isinstance(names, str) else list(names)
        if [name.strip() for name in names] == wanted:
            return list(mark.args[1])
    raise LookupError(f"{test.__name__} has no parametrize mark for {argnames!r}")


# -- a world served by a real daphne -------------------------------------------------------------


class HttpApi:
    """What ``build_world`` needs of an API client, over HTTP to the server."""

    def __init__(self, client: httpx.Client) -> None:
        self.client = client

    def post(self, path: str, data: Any, format: str = "json") -> httpx.Response:
        assert format == "json"
        return self.client.post(path, json=data)


def _tree(root: Path, *, skip: Path | None = None) -> dict[str, str]:
    """``test_api_bad_input``'s tree of ``root``, less what the server changes by itself
    (left out before it is read: the health probe is gone as soon as it is written)."""
    out: dict[str, str] = {}
    if not root.exists():
        return out
    for path in root.rglob("*"):
        if skip is not None and (path == skip or skip in path.parents):
            continue
        if SERVER_LOG.match(path.name) or HEALTH_PROBE.fullmatch(path.name):
            continue
        rel = str(path.relative_to(root))
        out[rel] = "dir" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def frozen(root: Path) -> dict[str, Any]:
    """``snapshot`` of ``test_api_bad_input`` (the same parts), with its trees less what the
    server changes by itself (``SERVER_LOG``, ``HEALTH_PROBE``)."""
    return {
        "items": list(Item.objects.order_by("id").values()),
        "queues": list(Queue.objects.order_by("name").values()),
        "threads": list(Thread.objects.order_by("queue_id", "thread_id").values()),
        "keys": list(ApiKey.objects.order_by("id").values()),
        "state": _tree(root),
        "beside": _tree(root.parent, skip=root),
        "above": sorted(p.name for p in root.parent.parent.iterdir()),
    }


def test_the_snapshot_has_the_parts_of_test_api_bad_input(state_root, db):
    """``frozen`` compares what ``test_api_bad_input.snapshot`` compares, no less."""
    assert set(frozen(state_root)) == set(snapshot(state_root))


def describe(part: str, before: Any, after: Any) -> str:
    """What changed in one part of the snapshot: the paths or rows added, gone or changed."""
    if isinstance(before, dict) and isinstance(after, dict):
        added = sorted(set(after) - set(before))
        gone = sorted(set(before) - set(after))
        changed = sorted(k for k in set(before) & set(after) if before[k] != after[k])
        return f"{part} (added {added}, gone {gone}, changed {changed})"
    if isinstance(before, list) and isinstance(after, list):
        if all(isinstance(row, dict) and "id" in row for row in before + after):
            return describe(
                part, {r["id"]: r for r in before}, {r["id"]: r for r in after}
            ).replace("changed [", "changed rows [")
        if len(before) == len(after):
            rows = [f"{b} -> {a}" for b, a in zip(before, after, strict=True) if b != a]
            return f"{part} ({rows})"[:2000]
    return f"{part} ({before!r} -> {after!r})"[:2000]


@dataclass
class Answer:
    status: int
    content_type: str
    body: bytes


@dataclass
class Case:
    name: str
    method: str
    path: str
    body: Any = None
    raw: bytes | None = None
    content_type: str = "application/json"
    statuses: tuple[int, ...] = ()  # empty: any 4xx
    names: str | None = None  # the error message must name this


class Daphne:
    """One daphne, one key and one world; sends cases and judges their answers."""

    def __init__(self, server: Any, key: str, root: Path) -> None:
        self.server = server
        self.key = key
        self.root = root
        self.client = httpx.Client(
            base_url=server.url, headers={"Authorization": f"Token {key}"}, timeout=30
        )

        def make_queue(name: str, **settings: Any) -> None:
            answer = self.client.put(f"/api/queues/{name}", json=settings)
            assert answer.status_code in (200, 201), answer.text

        # build_world uses only its client's post(path, data, format="json"), which HttpApi
        # gives over HTTP; its World.api is typed for the test client's other uses.
        self.world: World = build_world(cast(Any, HttpApi(self.client)), make_queue, root)
        self.world.before = frozen(root)
        self.failures: list[str] = []

    def send(self, case: Case) -> Answer:
        """The request as written: the path's bytes untouched, the body as given."""
        path = self.world.fill(case.path)
        if case.raw is not None:
            body = case.raw.replace(b"<lease>", self.world.lease.encode())
        elif case.body is None:
            body = b""
        else:
            body = json.dumps(self.world.fill(case.body)).encode()
        connection = http.client.HTTPConnection("127.0.0.1", self.server.port, timeout=30)
        try:
            connection.request(
                case.method.upper(),
                path,
                body=body,
                headers={
                    "Authorization": f"Token {self.key}",
                    "Content-Type": case.content_type,
                    "Content-Length": str(len(body)),
                },
            )
            response = connection.getresponse()
            return Answer(response.status, response.getheader("Content-Type", ""), response.read())
        finally:
            connection.close()

    def refused(self, case: Case) -> None:
        """Send ``case``; note what is wrong with its answer, or with the world after it."""
        try:
            answer = self.send(case)
        except (OSError, http.client.HTTPException) as exc:
            self.failures.append(f"{case.name}: no answer ({exc!r})")
            return
        wrong = self._judge(case, answer)
        after = frozen(self.root)
        changed = [
            describe(part, self.world.before[part], after[part])
            for part in self.world.before
            if after[part] != self.world.before[part]
        ]
        if changed:
            wrong.append(f"changed {'; '.join(changed)}")
            self.world.before = after  # judge the next case against what this one left
        if wrong:
            self.failures.append(
                f"{case.name} ({case.method.upper()} {case.path}): {'; '.join(wrong)}: "
                f"{answer.status} {answer.body[:300]!r}"
            )

    @staticmethod
    def _judge(case: Case, answer: Answer) -> list[str]:
        wrong = []
        if not 400 <= answer.status < 500:
            wrong.append("not a 4xx")
        elif case.statuses and answer.status not in case.statuses:
            wrong.append(f"not {case.statuses}")
        if not answer.content_type.startswith("application/json"):
            return [*wrong, f"Content-Type {answer.content_type!r}"]
        try:
            body = json.loads(answer.body)
        except ValueError:
            return [*wrong, "no JSON body"]
        error = body.get("error") if isinstance(body, dict) else None
        if (
            not isinstance(body, dict)
            or set(body) != {"error"}
            or not isinstance(error, dict)
            or set(error) != {"code", "message"}
            or not all(isinstance(error[k], str) and error[k] for k in ("code", "message"))
        ):
            return [*wrong, "not the error envelope"]
        if case.names is not None and case.names not in error["message"]:
            wrong.append(f"the message does not name {case.names!r}")
        return wrong

    def run(self, cases_: Iterable[Case]) -> None:
        count = 0
        for case in cases_:
            self.refused(case)
            count += 1
        assert count, "no cases"
        assert not self.failures, f"{len(self.failures)} of {count} cases:\n" + "\n".join(
            self.failures
        )

    def close(self) -> None:
        self.client.close()


@pytest.fixture
def daphne_factory(server_factory, make_key, state_root) -> Iterator[Any]:
    made: list[Daphne] = []

    def make(**env: str) -> Daphne:
        daphne = Daphne(server_factory(**env), make_key(), state_root)
        made.append(daphne)
        return daphne

    yield make
    for daphne in made:
        daphne.close()


@pytest.fixture
def daphne(daphne_factory) -> Daphne:
    return daphne_factory()


# -- the control ----------------------------------------------------------------------------------


@pytest.mark.parametrize("endpoint", sorted(BODY_ENDPOINTS))
def test_over_daphne_the_good_bodies_are_accepted(daphne, endpoint):
    """The bodies the cases below corrupt are accepted as sent, over the same HTTP: a refusal
    below is the corruption's, not a broken baseline's (a wrong key, a wrong lease)."""
    method, path, body = BODY_ENDPOINTS[endpoint]
    answer = daphne.send(Case(endpoint, method, path, body))
    assert answer.status in (200, 201), answer.body
    accepted = json.loads(answer.body)
    if endpoint in ("result", "fail", "extend"):
        assert accepted["accepted"] is True, accepted
    if endpoint == "claim":
        world = daphne.world
        assert {i["id"] for i in accepted["items"]} == {world.pending, world.threaded}
    if endpoint == "bulk_delete":
        assert accepted == {"deleted": 2}
    assert frozen(daphne.root) != daphne.world.before


# -- the families of cases ----------------------------------------------------------------------


def body_cases() -> Iterator[Case]:
    for endpoint, (method, path, body) in sorted(BODY_ENDPOINTS.items()):
        for kind, raw in sorted(MALFORMED.items()):
            yield Case(f"malformed {kind} to {endpoint}", method, path, raw=raw, statuses=(400,))
        for kind, value in sorted(NON_OBJECTS.items()):
            raw = json.dumps(value).encode()
            yield Case(f"non-object {kind} to {endpoint}", method, path, raw=raw, statuses=(400,))
        content_types = parametrized(
            cases.test_body_that_is_not_json_media_type_is_refused_with_415, "content_type"
        )
        for content_type in content_types:
            yield Case(
                f"{content_type} to {endpoint}",
                method,
                path,
                body,
                content_type=content_type,
                statuses=(415,),
            )


def test_over_daphne_malformed_non_object_and_non_json_bodies_are_refused(daphne):
    daphne.run(body_cases())


def field_cases() -> Iterator[Case]:
    def at(endpoint: str) -> tuple[str, str]:
        method, path, _good = BODY_ENDPOINTS[endpoint]
        return method, path

    for n, (endpoint, body) in enumerate(WRONG_TYPES):
        yield Case(f"wrong type #{n} to {endpoint}", *at(endpoint), body, statuses=(400,))
    for endpoint, body, name in UNKNOWN_FIELDS:
        yield Case(
            f"unknown field {name} to {endpoint}", *at(endpoint), body, statuses=(400,), names=name
        )
    for n, (endpoint, body) in enumerate(MISSING_FIELDS):
        yield Case(f"missing field #{n} to {endpoint}", *at(endpoint), body, statuses=(400,))
    empty = parametrized(
        cases.test_empty_body_where_fields_are_required_is_refused_with_400, "endpoint"
    )
    for endpoint in empty:
        yield Case(f"empty body to {endpoint}", *at(endpoint), raw=b"", statuses=(400,))
    yield Case(
        "bulk delete with both ids and status",
        "post",
        "/api/queues/q/items/delete",
        {"ids": ["{pending}"], "status": "pending"},
        statuses=(400,),
    )
    for n, (endpoint, body) in enumerate(OUT_OF_RANGE):
        yield Case(f"out of range #{n} to {endpoint}", *at(endpoint), body, statuses=(400,))
    yield Case(
        "invalid settings for a new queue",
        "put",
        "/api/queues/fresh",
        {"leaseSeconds": -1},
        statuses=(400,),
    )


def test_over_daphne_wrong_unknown_missing_and_out_of_range_fields_are_refused(daphne):
    daphne.run(field_cases())
    assert not (daphne.root / "fresh").exists()


def text_cases() -> Iterator[Case]:
    for n, (endpoint, raw) in enumerate(NON_FINITE):
        method, path, _good = BODY_ENDPOINTS[endpoint]
        yield Case(f"non-finite #{n} to {endpoint}", method, path, raw=raw, statuses=(400,))
    for n, (endpoint, raw) in enumerate(LONE_SURROGATES):
        method, path, _good = BODY_ENDPOINTS[endpoint]
        yield Case(f"lone surrogate #{n} to {endpoint}", method, path, raw=raw, statuses=(400,))


def test_over_daphne_nan_infinity_and_lone_surrogates_are_refused(daphne):
    daphne.run(text_cases())


def queue_name_cases() -> Iterator[Case]:
    for endpoint in sorted(set(QUEUE_ENDPOINTS) - {"put_queue"}):
        method, path, body = QUEUE_ENDPOINTS[endpoint]
        yield Case(
            f"unknown queue to {endpoint}",
            method,
            path.replace("{name}", "nosuch"),
            body,
            statuses=(404,),
        )
    for endpoint, (method, path, body) in sorted(QUEUE_ENDPOINTS.items()):
        for name in BAD_QUEUE_NAMES:
            yield Case(
                f"queue name {name!r} to {endpoint}",
                method,
                path.replace("{name}", name),
                body,
                statuses=(400, 404),
            )
    targets = parametrized(
        cases.test_queue_name_aimed_at_a_path_is_refused_as_a_dead_letter_target, "name"
    )
    for name in targets:
        target = name.replace("%2e", ".").replace("%00", "\x00")
        yield Case(
            f"dead-letter queue {name!r}",
            "put",
            "/api/queues/q",
            {"deadLetterQueue": target},
            statuses=(400,),
        )


def test_over_daphne_unknown_queues_and_queue_names_aimed_at_paths_are_refused(daphne):
    daphne.run(queue_name_cases())


def item_id_cases() -> Iterator[Case]:
    missing = "00000000000000000000"
    for endpoint in sorted(set(ITEM_ENDPOINTS) - {"result"}):
        method, path, body = ITEM_ENDPOINTS[endpoint]
        yield Case(
            f"unknown item to {endpoint}",
            method,
            path.replace("{id}", missing),
            body,
            statuses=(404,),
        )
    for endpoint, (method, path, body) in sorted(ITEM_ENDPOINTS.items()):
        for item_id in BAD_ITEM_IDS:
            yield Case(
                f"item id {item_id!r} to {endpoint}",
                method,
                path.replace("{id}", item_id),
                body,
                statuses=(400, 404),
            )


def test_over_daphne_unknown_items_and_item_ids_aimed_at_paths_are_refused(daphne):
    daphne.run(item_id_cases())
    # Rule 9: a result for an item that is gone is answered, not refused, and changes nothing.
    answer = daphne.send(
        Case("result", "post", "/api/items/00000000000000000000/result", {"result": 1})
    )
    assert (answer.status, json.loads(answer.body)) == (200, {"accepted": False, "status": None})
    assert frozen(daphne.root) == daphne.world.before


def route_cases() -> Iterator[Case]:
    route_miss = cases.test_route_miss_is_a_json_404
    for method in parametrized(route_miss, "method"):
        for path in parametrized(route_miss, "path"):
            yield Case(f"route miss {method} {path}", method, path, {"payload": 1}, statuses=(404,))
    for method, path in parametrized(cases.test_wrong_method_is_refused_with_405, "method, path"):
        yield Case(f"wrong method {method} {path}", method, path, {"payload": 1}, statuses=(405,))


def test_over_daphne_route_misses_and_wrong_methods_are_refused(daphne):
    daphne.run(route_cases())


def wire(at: datetime) -> str:
    return at.astimezone(UTC).isoformat().replace("+00:00", "Z")


def batch_and_schedule_cases() -> Iterator[Case]:
    items = "/api/queues/q/items"
    yield Case(
        "batch over 1000 items",
        "post",
        items,
        {"items": [{"payload": i} for i in range(1001)]},
        statuses=(413,),
    )
    yield Case("empty batch", "post", items, {"items": []}, statuses=(400,))
    yield Case(
        "batch with one invalid member",
        "post",
        items,
        {"items": [{"payload": 1}, {"payload": 2, "threadId": 7}, {"payload": 3}]},
        statuses=(400,),
    )
    later = wire(datetime.now(UTC) + timedelta(hours=2))  # the world's queueSeconds is 3600
    yield Case(
        "scheduledAt beyond the queue timeout",
        "post",
        items,
        {"payload": 1, "scheduledAt": later},
        statuses=(409,),
    )
    yield Case(
        "delay beyond the queue timeout",
        "post",
        items,
        {"payload": 1, "delaySeconds": 3700},
        statuses=(409,),
    )
    yield Case(
        "batch with one member beyond the queue timeout",
        "post",
        items,
        {"items": [{"payload": 1}, {"payload": 2, "scheduledAt": later}]},
        statuses=(409,),
    )
    for when in parametrized(cases.test_naive_scheduled_at_is_refused_with_400, "when"):
        yield Case(
            f"naive scheduledAt {when!r}",
            "post",
            items,
            {"payload": 1, "scheduledAt": when},
            statuses=(400,),
        )
    for when in parametrized(cases.test_unparseable_scheduled_at_is_refused_with_400, "when"):
        yield Case(
            f"unparseable scheduledAt {when!r}",
            "post",
            items,
            {"payload": 1, "scheduledAt": when},
            statuses=(400,),
        )
    soon = wire(datetime.now(UTC) + timedelta(minutes=1))
    yield Case(
        "both scheduledAt and delaySeconds",
        "post",
        items,
        {"payload": 1, "scheduledAt": soon, "delaySeconds": 60},
        statuses=(400,),
    )


def test_over_daphne_bad_batches_and_schedules_post_nothing(daphne):
    daphne.run(batch_and_schedule_cases())


def size_cases() -> Iterator[Case]:
    items = "/api/queues/q/items"
    yield Case("payload over the limit", "post", items, {"payload": "x" * 100}, statuses=(413,))
    yield Case(
        "batch with one payload over the limit",
        "post",
        items,
        {"items": [{"payload": 1}, {"payload": {"big": "x" * 100}}, {"payload": 2}]},
        statuses=(413,),
    )
    yield Case(
        "result over the limit",
        "post",
        "/api/items/{processing}/result",
        {"result": ["x" * 100]},
        statuses=(413,),
    )
    yield Case(
        "result over the limit for a pending item",
        "post",
        "/api/items/{pending}/result",
        {"result": "x" * 100},
        statuses=(413,),
    )
    yield Case(
        "payload over the limit in UTF-8 bytes, not characters",
        "post",
        items,
        {"payload": "€" * 40},
        statuses=(413,),
    )
    yield Case(
        "request body over the body limit",
        "post",
        items,
        {"items": [{"payload": i} for i in range(200)]},
        statuses=(413,),
    )


def test_over_daphne_payloads_results_and_bodies_over_their_limits_are_refused(daphne_factory):
    # test_api_bad_input's limits (64-byte payloads, a 1000-byte request body), as settings of
    # the server.
    daphne = daphne_factory(TASKHOSTER_MAX_PAYLOAD_BYTES="64", TASKHOSTER_MAX_BODY_BYTES="1000")
    daphne.run(size_cases())


def query_cases() -> Iterator[Case]:
    listing = "/api/queues/q/items"
    for cursor in parametrized(cases.test_invalid_cursor_is_refused_with_400, "cursor"):
        yield Case(f"cursor {cursor!r}", "get", f"{listing}?cursor={cursor}", statuses=(400,))
    for status in parametrized(cases.test_invalid_status_filter_is_refused_with_400, "status"):
        yield Case(f"status {status!r}", "get", f"{listing}?status={status}", statuses=(400,))
    for thread_id in parametrized(
        cases.test_invalid_thread_id_filter_is_refused_with_400, "thread_id"
    ):
        yield Case(
            f"threadId {thread_id!r}", "get", f"{listing}?threadId={thread_id}", statuses=(400,)
        )
    for limit in parametrized(cases.test_limit_out_of_range_is_refused_with_400, "limit"):
        yield Case(f"limit {limit!r}", "get", f"{listing}?limit={limit}", statuses=(400,))
    waits = cases.test_wait_out_of_range_is_refused_with_400
    for item in parametrized(waits, "item"):
        for wait in parametrized(waits, "wait"):
            yield Case(
                f"wait {wait!r} for {item}",
                "get",
                f"/api/items/{item}?wait={wait}",
                statuses=(400,),
            )


def test_over_daphne_bad_query_parameters_are_refused(daphne):
    daphne.run(query_cases())
    # The refused reads of the finished item did not start its fetched clock either.
    assert Item.objects.get(id=daphne.world.finished).fetched_at is None


def conflict_cases() -> Iterator[Case]:
    restarts = cases.test_restart_of_an_item_that_is_not_failed_is_refused_with_409
    for item in parametrized(restarts, "item"):
        yield Case(f"restart of {item}", "post", f"/api/items/{item}/restart", statuses=(409,))


def test_over_daphne_conflicts_are_refused_and_bulk_deletes_stay_in_their_queue(daphne):
    daphne.run(conflict_cases())
    answer = daphne.send(
        Case("bulk delete", "post", "/api/queues/q/items/delete", {"ids": ["{other}"]})
    )
    assert (answer.status, json.loads(answer.body)) == (200, {"deleted": 0})
    assert frozen(daphne.root) == daphne.world.before
