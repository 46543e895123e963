"""Authentication and authorisation (SPEC section 5, I8): ``Authorization: Token <key>`` on every
call; a missing, malformed, wrong or revoked key is 401; a key without the scope, or limited to
other queues, is 403 (an item of a queue it may not use is not found, 404, as a missing one);
a refused call changes nothing. Keys are stored hashed and made by
``manage.py createkey``; the admin is for staff only."""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Callable
from typing import Any

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from taskhoster.models import ApiKey, Queue
from tests.integration.test_api_bad_input import (
    LEASE,
    World,
    build_world,
    refused,
    send,
    snapshot,
)

SCOPES = {"produce", "work", "manage"}

# name: (method, path, body, the scopes that may call it; None = any key)
ENDPOINTS: dict[str, tuple[str, str, Any, set[str] | None]] = {
    "list_queues": ("get", "/api/queues", None, None),
    "get_queue": ("get", "/api/queues/q", None, None),
    "put_queue": ("put", "/api/queues/q", {"leaseSeconds": 30}, {"manage"}),
    "delete_queue": ("delete", "/api/queues/q", None, {"manage"}),
    "post_item": ("post", "/api/queues/q/items", {"payload": 1}, {"produce"}),
    "list_items": ("get", "/api/queues/q/items", None, {"produce", "manage"}),
    "bulk_delete": ("post", "/api/queues/q/items/delete", {"status": "pending"}, {"manage"}),
    "claim": ("post", "/api/queues/q/claim", {"max": 5}, {"work"}),
    "get_item": ("get", "/api/items/{finished}", None, {"produce"}),
    "delete_item": ("delete", "/api/items/{pending}", None, {"produce", "manage"}),
    "restart": ("post", "/api/items/{failed}/restart", None, {"manage"}),
    "result": ("post", "/api/items/{processing}/result", {"result": 1}, {"work"}),
    "fail": ("post", "/api/items/{processing}/fail", {"lease": LEASE, "retry": False}, {"work"}),
    "extend": ("post", "/api/items/{processing}/extend", {"lease": LEASE}, {"work"}),
}
SCOPED = sorted(name for name, spec in ENDPOINTS.items() if spec[3] is not None)
QUEUE_SCOPED = sorted(set(ENDPOINTS) - {"list_queues"})


def on_other_queue(path: str) -> str:
    """The same endpoint aimed at queue ``other`` (or its item)."""
    path = path.replace("/api/queues/q", "/api/queues/other")
    for name in ("finished", "pending", "failed", "processing"):
        path = path.replace("{" + name + "}", "{other}")
    return path


@pytest.fixture
def world(api: APIClient, make_queue: Any, state_root: Any) -> World:
    return build_world(api, make_queue, state_root)


@pytest.fixture
def client_with(make_key: Callable[..., str], world: World) -> Callable[..., APIClient]:
    """A client sending ``Authorization: <header>``, or a fresh key's ``Token`` header; the
    world is re-frozen after the key exists, so the key itself is not a change."""

    def make(
        scopes: str | None = None, queues: list[str] | None = None, *, header: str | None = None
    ) -> APIClient:
        client = APIClient()
        if header is None and scopes is not None:
            header = f"Token {make_key(scopes, queues)}"
        if header is not None:
            client.credentials(HTTP_AUTHORIZATION=header)
        world.freeze()
        return client

    return make


def call(world: World, client: APIClient, name: str, *, other: bool = False) -> Any:
    method, path, body, _scopes = ENDPOINTS[name]
    return send(world, method, on_other_queue(path) if other else path, body, client=client)


def unauthorized(world: World, response: Any) -> None:
    error = refused(world, response, 401)
    assert error["code"]
    assert response["WWW-Authenticate"].startswith("Token")


# -- 401 -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(ENDPOINTS))
def test_a_call_without_a_key_is_refused_with_401(world, client_with, name):
    unauthorized(world, call(world, client_with(), name))


@pytest.mark.parametrize("name", sorted(ENDPOINTS))
@pytest.mark.parametrize(
    "scheme",
    [
        "Bearer {key}",
        "Basic {basic}",
        "{key}",
        "Token",
        "Token ",
        "Token {key} extra",
        "Tokens {key}",
        "Key {key}",
    ],
)
def test_a_key_in_the_wrong_scheme_is_refused_with_401(world, client_with, make_key, name, scheme):
    key = make_key()
    basic = base64.b64encode(f"user:{key}".encode()).decode()
    client = client_with(header=scheme.format(key=key, basic=basic))
    unauthorized(world, call(world, client, name))


@pytest.mark.parametrize("name", sorted(ENDPOINTS))
@pytest.mark.parametrize(
    "wrong", ["th_not-a-key", "{key}x", "{prefix}", "{upper}", "x" * 500, "{hash}"]
)
def test_a_wrong_key_is_refused_with_401(world, client_with, make_key, name, wrong):
    key = make_key()
    header = "Token " + wrong.format(
        key=key, prefix=key[:10], upper=key.upper(), hash=hashlib.sha256(key.encode()).hexdigest()
    )
    unauthorized(world, call(world, client_with(header=header), name))


@pytest.mark.parametrize("name", sorted(ENDPOINTS))
def test_a_revoked_key_is_refused_with_401(world, client_with, make_key, name):
    key = make_key()
    client = client_with(header=f"Token {key}")
    assert call(world, client, "list_queues").status_code == 200
    ApiKey.objects.filter(key_hash=hashlib.sha256(key.encode()).hexdigest()).update(
        revoked_at=timezone.now()
    )
    world.freeze()
    unauthorized(world, call(world, client, name))


def test_the_scheme_word_is_case_insensitive(world, client_with, make_key):
    client = client_with(header=f"token {make_key()}")
    assert call(world, client, "list_queues").status_code == 200


def test_an_admin_session_is_not_an_api_key(world, client_with, django_user_model):
    admin = django_user_model.objects.create_superuser("boss", "boss@example.com", "pw-123456")
    client = client_with()
    client.force_login(admin)
    world.freeze()
    unauthorized(world, call(world, client, "list_queues"))
    unauthorized(world, call(world, client, "post_item"))


# -- 403: scopes -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SCOPED)
def test_a_key_without_the_scope_is_refused_with_403(world, client_with, name):
    allowed = ENDPOINTS[name][3]
    assert allowed is not None
    others = ",".join(sorted(SCOPES - allowed))
    error = refused(world, call(world, client_with(others), name), 403)
    assert error["code"] == "forbidden"


@pytest.mark.parametrize("name", SCOPED)
def test_a_key_with_just_one_allowed_scope_is_let_through(world, client_with, name):
    allowed = ENDPOINTS[name][3]
    assert allowed is not None
    for scope in sorted(allowed):
        response = call(world, client_with(scope), name)
        assert response.status_code in (200, 201, 204), (scope, response.content)
        if name in ("delete_queue", "delete_item", "restart"):
            break  # the first call changed what the second would act on


@pytest.mark.parametrize("name", ["list_queues", "get_queue"])
@pytest.mark.parametrize("scope", sorted(SCOPES))
def test_any_scope_may_read_queues(world, client_with, name, scope):
    response = call(world, client_with(scope), name)
    assert response.status_code == 200, response.content


# -- 403: queues -------------------------------------------------------------------------------


ITEM_SCOPED = sorted(n for n in QUEUE_SCOPED if "/api/items/" in ENDPOINTS[n][1])
QUEUE_PATH_SCOPED = sorted(set(QUEUE_SCOPED) - set(ITEM_SCOPED))


@pytest.mark.parametrize("name", QUEUE_PATH_SCOPED)
def test_a_key_limited_to_other_queues_is_refused_with_403(world, client_with, name):
    client = client_with("produce,work,manage", ["q"])
    error = refused(world, call(world, client, name, other=True), 403)
    assert error["code"] == "forbidden"


@pytest.mark.parametrize("name", ITEM_SCOPED)
def test_an_item_of_a_queue_the_key_may_not_use_is_answered_as_a_missing_one(
    world, client_with, name
):
    """A 403 would tell a key limited to some queues which ids exist in the others: such an
    item is not found for it, exactly as an id nobody posted (and nothing changes)."""
    client = client_with("produce,work,manage", ["q"])
    method, path, body, _scopes = ENDPOINTS[name]
    elsewhere = send(world, method, on_other_queue(path), body, client=client)
    missing = on_other_queue(path).replace("{other}", "0661" + "0" * 16)
    nowhere = send(world, method, missing, body, client=client)
    assert elsewhere.status_code == nowhere.status_code
    if name == "result":  # rule 9's answer for a result of no item: accepted false
        assert elsewhere.json() == nowhere.json() == {"accepted": False, "status": None}
        assert snapshot(world.root) == world.before
        return
    error = refused(world, elsewhere, 404)
    assert error["code"] == "item_not_found"
    assert refused(world, nowhere, 404)["code"] == "item_not_found"


@pytest.mark.parametrize("name", QUEUE_SCOPED)
def test_a_key_limited_to_a_queue_may_use_that_queue(world, client_with, name):
    client = client_with("produce,work,manage", ["q", "unrelated"])
    response = call(world, client, name)
    assert response.status_code in (200, 201, 204), response.content


def test_a_key_limited_to_queues_cannot_create_another_queue(world, client_with):
    client = client_with("manage", ["q"])
    refused(world, send(world, "put", "/api/queues/brand-new", {}, client=client), 403)
    assert not Queue.objects.filter(name="brand-new").exists()
    assert not (world.root / "brand-new").exists()


def test_a_key_limited_to_queues_lists_only_its_queues(world, client_with, make_queue):
    make_queue("third")
    client = client_with("produce", ["q", "third", "not-yet"])
    names = [queue["name"] for queue in client.get("/api/queues").json()]
    assert names == ["q", "third"]
    everything = [queue["name"] for queue in client_with("produce").get("/api/queues").json()]
    assert everything == ["other", "q", "third"]


# -- keys --------------------------------------------------------------------------------------


def test_keys_are_stored_only_as_a_hash(world, make_key):
    key = make_key("produce", ["q"])
    row = ApiKey.objects.get(key_hash=hashlib.sha256(key.encode()).hexdigest())
    values = ApiKey.objects.filter(id=row.id).values().first()
    assert values is not None
    stored = " ".join(str(v) for v in values.values())
    assert key not in stored
    assert key[10:] not in stored
    assert row.prefix == key[: len(row.prefix)]
    assert len(row.prefix) < len(key) // 2
    for path in world.root.rglob("*"):
        if path.is_file():
            assert key.encode() not in path.read_bytes()


def test_two_keys_are_different_secrets(make_key):
    keys = {make_key() for _ in range(5)}
    assert len(keys) == 5
    assert all(len(k) >= 32 for k in keys)


@pytest.mark.slow
def test_createkey_prints_the_key_alone_and_it_works(manage, make_queue):
    make_queue("q")
    make_queue("other")
    done = manage("createkey", "--name", "ci", "--scopes", "produce,manage", "--queues", "q")
    assert done.stdout.count("\n") <= 1
    key = done.stdout.strip()
    assert key
    assert " " not in key
    row = ApiKey.objects.get(key_hash=hashlib.sha256(key.encode()).hexdigest())
    assert row.name == "ci"
    assert sorted(row.scopes) == ["manage", "produce"]
    assert row.queues == ["q"]
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {key}")
    posted = client.post("/api/queues/q/items", {"payload": 1}, format="json")
    assert posted.status_code == 201, posted.content
    assert client.post("/api/queues/other/items", {"payload": 1}, format="json").status_code == 403
    assert client.post("/api/queues/q/claim", {}, format="json").status_code == 403


@pytest.mark.slow
@pytest.mark.parametrize(
    "args",
    [["--scopes", "produce,admin"], ["--scopes", ""], ["--scopes", "work", "--queues", "../etc"]],
)
def test_createkey_refuses_bad_arguments_and_prints_no_key(manage, args):
    done = manage("createkey", "--name", "bad", *args, check=False)
    assert done.returncode != 0
    assert done.stdout.strip() == ""
    assert not ApiKey.objects.filter(name="bad").exists()


# -- admin -------------------------------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize(
    "path", ["/admin/", "/admin/taskhoster/item/", "/admin/taskhoster/apikey/"]
)
def test_the_admin_sends_anonymous_users_to_its_login(client, path):
    response = client.get(path)
    assert response.status_code == 302
    assert response["Location"].startswith("/admin/login/")


@pytest.mark.django_db
def test_the_admin_refuses_a_logged_in_non_staff_user(client, django_user_model):
    user = django_user_model.objects.create_user("worker", "w@example.com", "pw-123456")
    client.force_login(user)
    response = client.get("/admin/")
    assert response.status_code == 302
    assert response["Location"].startswith("/admin/login/")
    assert client.get("/admin/taskhoster/item/").status_code == 302


@pytest.mark.django_db
def test_the_admin_login_refuses_non_staff_credentials(client, django_user_model):
    django_user_model.objects.create_user("worker", "w@example.com", "pw-123456")
    response = client.post(
        "/admin/login/?next=/admin/",
        {"username": "worker", "password": "pw-123456", "next": "/admin/"},
    )
    assert response.status_code == 200  # the form again, with an error
    assert b"staff account" in response.content
    assert client.get("/admin/").status_code == 302


@pytest.mark.django_db
def test_the_admin_lets_staff_in(client, django_user_model):
    staff = django_user_model.objects.create_superuser("boss", "boss@example.com", "pw-123456")
    client.force_login(staff)
    assert client.get("/admin/").status_code == 200
    assert client.get("/admin/taskhoster/item/").status_code == 200


def test_a_refused_call_leaves_the_world_as_it_was(world, client_with):
    """Control for ``refused``: an allowed call does change the snapshot it compares."""
    client = client_with("produce")
    before = snapshot(world.root)
    assert call(world, client, "post_item").status_code == 201
    assert snapshot(world.root) != before
