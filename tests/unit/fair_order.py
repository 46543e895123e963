"""Section 8.1's claim order as the models of the rules write it (``test_rules_model`` and
``test_thread_model``), from the words, not from the engine: higher priority first; within a
priority, in the line's order, but each thread's first member before any thread's second (a
claim hands out the heads of many threads before a second member of one)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar


class Member(Protocol):
    priority: int
    thread: str | None


M = TypeVar("M", bound=Member)


def fair_order(claimable: Sequence[M]) -> list[M]:
    """``claimable`` (already in priority, then line order) in the order a claim takes it."""
    out: list[M] = []
    for priority in sorted({i.priority for i in claimable}, reverse=True):
        level = [i for i in claimable if i.priority == priority]
        gave = {i.thread for i in out if i.thread is not None}
        firsts: list[M] = []
        for item in level:
            if item.thread is None or item.thread not in gave:
                firsts.append(item)
                if item.thread is not None:
                    gave.add(item.thread)
        out += firsts + [i for i in level if i not in firsts]
    return out
