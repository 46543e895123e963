"""A socket's held items keep the sum of their frames' sizes as they come and go: the
dispatcher's byte bound (``MAX_SOCKET_HELD_BYTES``) reads it before every push. Every change
moves their ``version``: the registry's listing of the socket is made again by it."""

from __future__ import annotations

import copy
import pickle
import random

from taskhoster.work.consumer import Held, HeldItems


def test_held_items_size_is_the_sum_of_the_frames_held_through_every_change() -> None:
    held = HeldItems()
    rng = random.Random(26)
    for step in range(2000):
        key = f"i{rng.randrange(40)}"
        action = rng.randrange(9)
        before, version = dict(held), held.version
        if action == 0:
            held[key] = Held("lease", "q", 1, rng.randrange(1, 5000))  # new or replaced
        elif action == 1 and key in held:
            del held[key]
        elif action == 2:
            held.pop(key, None)
        elif action == 3 and step % 97 == 0:
            held.clear()
        elif action == 4 and held and step % 5 == 0:
            held.popitem()
        elif action == 5:
            held.setdefault(key, Held("lease", "q", 1, rng.randrange(1, 5000)))
        elif action == 6:
            held.update({key: Held("lease", "q", 1, rng.randrange(1, 5000))})
        elif action == 7:
            held |= {key: Held("lease", "q", 1, rng.randrange(1, 5000))}
        else:
            held[key] = Held("lease", "q", 1, rng.randrange(1, 5000))
        assert held.size == sum(h.size for h in held.values()), step
        if dict(held) != before:
            assert held.version > version, f"step {step}: changed, version kept"
    assert held.pop("absent", "default") == "default"
    for twin in (
        held.copy(),
        copy.copy(held),
        copy.deepcopy(held),
        pickle.loads(pickle.dumps(held)),
        HeldItems(held),
        HeldItems(**held),
    ):
        assert isinstance(twin, HeldItems)
        assert twin == held
        assert twin.size == held.size
