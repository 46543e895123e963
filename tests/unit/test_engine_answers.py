"""Each operation's answer is its own outcome, as the state stood right after it, even when
later operations of the same group change the same item (one group commit, many callers).

Operations on one item often share a group: a socket hands its frames to the engine at
once, so an ``extend`` and the ``result`` after it, or two posts repeating one key, land in
one group. Each test here puts such a pair in one group on purpose (``run_group`` with the
list), against the real group, files and database.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import pytest

from taskhoster.engine import runner
from taskhoster.engine.ops import Delete, Extend, Fail, NewItem, Op, Result
from taskhoster.engine.posts import prepare_post

from .lifecycle_helpers import claim_one, post, row

pytestmark = pytest.mark.django_db(transaction=True)


def in_one_group(*ops: Op) -> list[Any]:
    """Run ``ops`` as one group; each one's answer (or its error), in order."""
    for op in ops:
        op.future = Future()
    runner.run_group(list(ops), 0)
    answers: list[Any] = []
    for op in ops:
        assert op.future is not None
        error = op.future.exception(timeout=10)
        answers.append(error if error is not None else op.future.result())
    return answers


def test_an_extend_answers_with_its_lease_when_a_result_follows_in_its_group(make_queue):
    make_queue("q", leaseSeconds=30)
    post()
    item = claim_one()
    extended, verdict = in_one_group(
        Extend(item_id=item.id, lease=item.lease, seconds=20),
        Result(item_id=item.id, result="done"),
    )
    accepted, extended_row = extended
    assert accepted is True
    assert extended_row.lease_expires_at is not None, "the extend's own outcome"
    assert extended_row.lease == item.lease
    assert verdict.accepted is True
    assert verdict.row.status == "finished"
    stored = row(item.id)
    assert stored.status == "finished"
    assert stored.lease_expires_at is None


def test_a_fail_answers_with_its_own_state_when_a_result_follows_in_its_group(make_queue):
    make_queue("q", backoffSeconds=30)
    post()
    item = claim_one()
    failed, verdict = in_one_group(
        Fail(item_id=item.id, lease=item.lease, error="boom", retry=True),
        Result(item_id=item.id, result="late but useful"),
    )
    assert failed.accepted is True
    assert failed.status == "pending"
    assert failed.row.status == "pending", "as the fail left it, not as the result did"
    assert failed.row.error == "boom"
    assert verdict.accepted is True
    assert verdict.row.status == "finished"


def test_two_posts_repeating_one_key_in_one_group_both_answer_with_the_payload(make_queue):
    make_queue("q")
    first, second = in_one_group(
        prepare_post("q", [NewItem(payload={"n": 1}, key="k")]),
        prepare_post("q", [NewItem(payload={"n": 2}, key="k")]),
    )
    (made,), (found,) = first, second
    assert made.created is True
    assert found.created is False
    assert found.row.id == made.row.id
    assert found.payload == {"n": 1}, "the item as a read shows it, never a null payload"


def test_a_key_repeated_after_its_item_finished_in_the_same_group_shows_the_result(make_queue):
    make_queue("q")
    item = post(payload="p", key="k")
    claimed = claim_one()
    assert claimed.id == item.id
    verdict, posted = in_one_group(
        Result(item_id=item.id, result="r"),
        prepare_post("q", [NewItem(payload="other", key="k")]),
    )
    assert verdict.accepted is True
    (again,) = posted
    assert again.created is False
    assert again.row.status == "finished", "as the result left it in this group"
    assert again.payload == "p"
    assert again.result == "r"


def test_a_key_whose_item_was_deleted_earlier_in_the_group_posts_a_new_item(make_queue):
    make_queue("q")
    item = post(payload="old", key="k")
    deleted, posted = in_one_group(
        Delete(ids=(item.id,)),
        prepare_post("q", [NewItem(payload="new", key="k")]),
    )
    assert deleted == 1
    (made,) = posted
    assert made.created is True
    assert made.row.id != item.id
    assert row(made.row.id).key == "k"


def test_a_group_that_committed_stands_when_its_connection_fails_on_the_way_out(
    make_queue, monkeypatch
):
    """Django turns autocommit back on after its COMMIT, before the commit's hooks run (a
    driver may meet the connection gone there): a connection lost there raises though the
    group committed. The group stands: answered, its files kept, not run a second time (a claim run
    again takes a second item, its first one left processing with its file put back). The
    loss is the driver's, made here at Django's boundary: a real one cannot be timed to that
    instant."""
    from django.db import OperationalError, connection

    from taskhoster.engine.common import store
    from taskhoster.engine.ops import Claim
    from taskhoster.models import Item
    from taskhoster.status import State

    make_queue("q")
    post(payload=1)
    post(payload=2)
    real = connection._set_autocommit  # type: ignore[attr-defined]
    lost: list[bool] = []

    def lose_it_once(autocommit: bool) -> None:
        if autocommit and connection.run_commit_hooks_on_set_autocommit_on and not lost:
            lost.append(True)
            if connection.vendor == "postgresql":  # (SQLite's file has no connection to lose)
                connection.connection.close()  # gone, as a lost connection is
            raise OperationalError("server closed the connection unexpectedly (a test's)")
        real(autocommit)

    monkeypatch.setattr(connection, "_set_autocommit", lose_it_once)
    (answer,) = in_one_group(Claim(queue_name="q", max_items=1))
    assert lost, "the connection was lost after the commit"
    assert not isinstance(answer, BaseException), answer
    (claimed,) = answer
    processing = Item.objects.filter(status="processing").values_list("id", "lease")
    assert list(processing) == [(claimed.row.id, claimed.row.lease)], "claimed once"
    assert store().item_path("q", State.PROCESSING, claimed.row.id).exists(), "its file kept"
