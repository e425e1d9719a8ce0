"""Fresh tensor and node names for what rewrites add."""

from __future__ import annotations

from typing import Iterable


class NameAllocator:
    """Fresh, deterministic tensor/node names that collide with nothing in the model."""

    def __init__(self, used: Iterable[str]):
        self.used = set(used)
        self._counters: dict[str, int] = {}

    def fresh(self, hint: str) -> str:
        if hint not in self.used:
            self.used.add(hint)
            return hint
        i = self._counters.get(hint, 0)
        while True:
            i += 1
            cand = f"{hint}_{i}"
            if cand not in self.used:
                self._counters[hint] = i
                self.used.add(cand)
                return cand
