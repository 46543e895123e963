"""The clients' backoff: bounded by its cap at any attempt."""

from __future__ import annotations

from taskhoster.client._http import retry_delay


def test_the_backoff_stays_at_its_cap_however_many_attempts_failed():
    """A worker's thousandth reconnect in a long outage waits the cap (with jitter), not an
    ``OverflowError`` that ends the worker (``2.0**1024`` does not fit a float)."""
    for attempt in (0, 1, 5, 60, 1024, 5000, 10**6):
        delay = retry_delay(attempt, 0.5, 30.0)
        assert 0.25 <= delay <= 30.0, (attempt, delay)
    assert all(15.0 <= retry_delay(5000, 0.5, 30.0) <= 30.0 for _ in range(100))
    assert all(0.25 <= retry_delay(0, 0.5, 30.0) <= 0.5 for _ in range(100))
