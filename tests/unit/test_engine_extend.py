"""Extend (rule 5): the current lease holder pushes its lease out, by at most leaseSeconds."""

from __future__ import annotations

from datetime import timedelta

import pytest

from taskhoster import engine

from .lifecycle_helpers import after, claim_one, post, row, utcnow

pytestmark = pytest.mark.django_db


# -- rule 5: extend -----------------------------------------------------------------------------


def test_extend_with_current_lease_pushes_expiry_by_lease_seconds(make_queue) -> None:
    make_queue("q", leaseSeconds=30)
    item = post()
    held = claim_one()
    before = utcnow()
    accepted, got = engine.extend(item_id=item.id, lease=held.lease)
    assert accepted is True
    stored = row(item.id).lease_expires_at
    assert got.lease_expires_at == stored
    assert stored is not None
    assert before + timedelta(seconds=30) <= stored <= utcnow() + timedelta(seconds=30)


@pytest.mark.parametrize(("asked", "granted"), [(5, 5), (30, 30), (31, 30), (10_000, 30)])
def test_extend_grants_asked_seconds_clamped_to_lease_seconds(make_queue, asked, granted) -> None:
    make_queue("q", leaseSeconds=30)
    item = post()
    held = claim_one()
    before = utcnow()
    accepted, _ = engine.extend(item_id=item.id, lease=held.lease, seconds=asked)
    assert accepted is True
    stored = row(item.id).lease_expires_at
    assert stored is not None
    assert before + timedelta(seconds=granted) <= stored <= utcnow() + timedelta(seconds=granted)


@pytest.mark.parametrize("lease", [None, "", "wrong"])
def test_extend_without_the_current_lease_is_refused(make_queue, lease) -> None:
    make_queue("q", leaseSeconds=30)
    item = post()
    held = claim_one()
    accepted, _ = engine.extend(item_id=item.id, lease=lease, seconds=30)
    assert accepted is False
    assert row(item.id).lease_expires_at == held.lease_expires_at


def test_extend_with_a_stale_lease_is_refused(make_queue) -> None:
    make_queue("q")
    item = post()
    first = claim_one()
    engine.sweep(at=after(first.lease_expires_at))
    second = claim_one()
    assert engine.extend(item_id=item.id, lease=first.lease)[0] is False
    assert row(item.id).lease_expires_at == second.lease_expires_at


def test_extended_lease_is_not_lapsed_by_a_sweep_at_the_old_expiry(make_queue) -> None:
    make_queue("q", leaseSeconds=30)
    item = post()
    held = claim_one()
    engine.extend(item_id=item.id, lease=held.lease, seconds=30)
    new_expiry = row(item.id).lease_expires_at
    old_expiry = held.lease_expires_at
    assert new_expiry is not None
    assert old_expiry is not None
    assert new_expiry > old_expiry
    assert engine.sweep(at=after(new_expiry, -0.000_001)).requeued == 0
    assert row(item.id).status == "processing"
    assert engine.sweep(at=new_expiry).requeued == 1


def test_extend_of_a_finished_item_is_refused(make_queue) -> None:
    make_queue("q")
    item = post()
    held = claim_one()
    engine.submit_result(item_id=item.id, result=1)
    assert engine.extend(item_id=item.id, lease=held.lease)[0] is False
    assert row(item.id).lease_expires_at is None
