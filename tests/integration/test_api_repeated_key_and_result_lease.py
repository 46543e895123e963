"""Two answers that must agree with the rest of the contract.

- A post repeating a live item's ``key`` answers that item as ``GET /api/items/{id}`` shows
  it (SPEC section 5: "returns that item"), its result included once it is finished: single
  posts and batches, in every state.
- A REST result may carry the claim's ``lease``, as the socket's result frame may; it
  changes nothing (a result is taken whatever its lease, rule 3), while a fail or extend with
  a stale lease is still refused.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import httpx
import pytest
from rest_framework.test import APIClient

from taskhoster import engine
from taskhoster.client import Producer
from taskhoster.models import Item
from taskhoster.timeutil import now as utcnow


def ok(response: Any, status: int = 200) -> Any:
    assert response.status_code == status, (response.status_code, response.content)
    return response.json()


def post(api: APIClient, status: int, **body: Any) -> dict[str, Any]:
    return dict(ok(api.post("/api/queues/q/items", body, format="json"), status))


def post_batch(api: APIClient, *items: dict[str, Any]) -> list[dict[str, Any]]:
    body = {"items": list(items)}
    return list(ok(api.post("/api/queues/q/items", body, format="json"), 201)["items"])


def claim_one(api: APIClient) -> dict[str, Any]:
    (item,) = ok(api.post("/api/queues/q/claim", {"max": 1}, format="json"))["items"]
    return dict(item)


def get(api: APIClient, item_id: str) -> dict[str, Any]:
    return dict(ok(api.get(f"/api/items/{item_id}")))


@pytest.fixture
def q(make_queue: Any) -> Any:
    return make_queue("q", maxAttempts=1)


# -- a repeated key answers the item as a read shows it ------------------------------------------


def test_a_repeated_key_of_a_finished_item_answers_its_result_as_get_does(api, q):
    first = post(api, 201, payload={"n": 1}, key="order-1")
    claim_one(api)
    verdict = ok(api.post(f"/api/items/{first['id']}/result", {"result": {"sent": True}}, "json"))
    assert verdict == {"accepted": True, "status": "finished"}

    again = post(api, 200, payload={"n": 2}, key="order-1")
    assert again["result"] == {"sent": True}
    assert again == get(api, first["id"])
    (in_batch, new) = post_batch(api, {"payload": 3, "key": "order-1"}, {"payload": 4})
    assert in_batch == get(api, first["id"])
    assert new["result"] is None
    assert Item.objects.count() == 2


@pytest.mark.parametrize("state", ["pending", "processing", "failed"])
def test_a_repeated_key_answers_what_get_shows_in_every_other_state(api, q, state):
    first = post(api, 201, payload="work", key="k")
    if state != "pending":
        claimed = claim_one(api)
    if state == "failed":
        body = {"lease": claimed["lease"], "error": "boom", "retry": False}
        assert ok(api.post(f"/api/items/{first['id']}/fail", body, format="json"))["accepted"]

    again = post(api, 200, payload="other", key="k")
    shown = get(api, first["id"])
    assert shown["status"] == state
    assert again == shown
    assert again["result"] is None
    (in_batch,) = post_batch(api, {"payload": "other", "key": "k"})
    assert in_batch == shown


@pytest.mark.slow
def test_the_python_client_gets_the_result_of_a_repeated_post(server_factory, make_key, make_queue):
    make_queue("q")
    server = server_factory()
    with Producer(url=server.url, key=make_key()) as producer:
        first = producer.post("q", {"n": 1}, key="once")
        with httpx.Client(
            base_url=server.url, headers={"Authorization": f"Token {make_key()}"}
        ) as w:
            assert w.post("/api/queues/q/claim", json={}).json()["items"][0]["id"] == first.id
            w.post(f"/api/items/{first.id}/result", json={"result": 42}).raise_for_status()
        again = producer.post("q", {"n": 1}, key="once")
    assert (again.id, again.status, again.result) == (first.id, "finished", 42)


# -- the lease on a REST result ------------------------------------------------------------------


def test_a_rest_result_takes_the_claims_lease(api, q):
    item = post(api, 201, payload=1)
    lease = claim_one(api)["lease"]
    body = {"result": "done", "lease": lease}
    verdict = ok(api.post(f"/api/items/{item['id']}/result", body, format="json"))
    assert verdict == {"accepted": True, "status": "finished"}
    assert get(api, item["id"])["result"] == "done"


def test_a_rest_result_with_a_stale_lease_still_wins_as_the_first_result(api, make_queue):
    make_queue("q")
    item = post(api, 201, payload=1)
    stale = claim_one(api)["lease"]
    # The lease lapses (the sweep, a day later) and another worker claims it: a new attempt,
    # a new lease.
    assert engine.requeue_if_lapsed(item_id=item["id"], at=utcnow() + timedelta(days=1))
    current = claim_one(api)["lease"]
    assert current != stale

    # A fail or extend naming the stale lease is refused and changes nothing ...
    fail = {"lease": stale, "error": "late", "retry": False}
    assert ok(api.post(f"/api/items/{item['id']}/fail", fail, format="json"))["accepted"] is False
    extend = {"lease": stale}
    assert (
        ok(api.post(f"/api/items/{item['id']}/extend", extend, format="json"))["accepted"] is False
    )
    assert get(api, item["id"])["status"] == "processing"
    # ... while a result naming it is taken (the first result wins), and a later one is not.
    first = {"result": "from the first worker", "lease": stale}
    assert ok(api.post(f"/api/items/{item['id']}/result", first, format="json")) == {
        "accepted": True,
        "status": "finished",
    }
    second = {"result": "from the second worker", "lease": current}
    assert ok(api.post(f"/api/items/{item['id']}/result", second, format="json")) == {
        "accepted": False,
        "status": "finished",
    }
    assert get(api, item["id"])["result"] == "from the first worker"


@pytest.mark.parametrize("lease", ["", "x" * 65, 5, ["l"], {"l": 1}, True])
def test_a_malformed_lease_on_a_rest_result_is_refused_and_changes_nothing(api, q, lease):
    item = post(api, 201, payload=1)
    claim_one(api)
    answer = api.post(f"/api/items/{item['id']}/result", {"result": 1, "lease": lease}, "json")
    assert answer.status_code == 400
    assert answer.json()["error"]["code"] == "invalid_lease"  # as the socket answers it
    assert "lease" in answer.json()["error"]["message"]
    assert get(api, item["id"])["status"] == "processing"


def test_a_null_lease_on_a_rest_result_is_refused(api, q):
    item = post(api, 201, payload=1)
    claim_one(api)
    answer = api.post(f"/api/items/{item['id']}/result", {"result": 1, "lease": None}, "json")
    assert answer.status_code == 400
    assert answer.json()["error"]["message"] == "lease must not be null"


def test_the_schema_shows_the_optional_lease_of_a_result(api):
    schema = ok(api.get("/api/schema", HTTP_ACCEPT="application/vnd.oai.openapi+json"))
    result = schema["components"]["schemas"]["Result"]
    assert result["required"] == ["result"]
    assert result["properties"]["lease"]["type"] == "string"
    assert (
        result["properties"]["lease"]["minLength"],
        result["properties"]["lease"]["maxLength"],
    ) == (1, 64)
