"""Fresh tensor and node names for what rewrites add."""

from __future__ import annotations

from typing import Iterable

import numpy as np


class NameAllocator:
    """Fresh, deterministic tensor/node names that collide with nothing in the model.

    ``used`` is taken as it is when it is a set (not copied). ``packed`` is more taken names: (the names
    joined with ``"\\0"`` between and around them, their ``hash`` values sorted). It holds a node-heavy
    graph's node names, which as a set of strings would cost ~90 bytes a name (108k names: 10 MB) and are
    asked about only when a hint happens to be one of them: a candidate whose hash is not among the hashes is
    not one of them; else the joined names are searched for it. Names holding a ``"\\0"`` themselves may make
    a few other candidates look taken too, never the other way round, so names stay unique and deterministic.
    After a few hits (a model optimized before, whose names the hints meet again and again) the packed names
    become a set."""

    _HITS_BEFORE_SET = 8
    # bits of the filter per packed name (a power of two at least this many times their count): a candidate
    # whose hash's bit is clear is no packed name, and ~1 in 16 of the others is searched for in the hashes
    _FILTER_BITS_PER_NAME = 16

    def __init__(self, used: Iterable[str], packed: tuple[str, np.ndarray] | None = None):
        self.used = used if type(used) is set else set(used)
        self._counters: dict[str, int] = {}
        self._packed = packed
        self._hits = 0
        self._filter, self._filter_mask = _hash_filter(packed[1], self._FILTER_BITS_PER_NAME) if packed else (b"", 0)

    def _taken(self, name: str) -> bool:
        if name in self.used:
            return True
        if self._packed is None:
            return False
        h = hash(name)
        bit = h & self._filter_mask
        if not (self._filter[bit >> 3] >> (bit & 7)) & 1:
            return False  # (the filter answers most candidates: a binary search costs ~1.3 µs a name, a
            # replayed 100,000-node head asked 200,000)
        joined, hashes = self._packed
        i = int(np.searchsorted(hashes, h))
        if i == len(hashes) or int(hashes[i]) != h or f"\0{name}\0" not in joined:
            return False
        self._hits += 1
        if self._hits >= self._HITS_BEFORE_SET:
            self.used.update(joined.split("\0"))
            self.used.discard("")
            self._packed = None
        return True

    def fresh(self, hint: str) -> str:
        if not self._taken(hint):
            self.used.add(hint)
            return hint
        i = self._counters.get(hint, 0)
        while True:
            i += 1
            cand = f"{hint}_{i}"
            if not self._taken(cand):
                self._counters[hint] = i
                self.used.add(cand)
                return cand


def _hash_filter(hashes: np.ndarray, bits_per_name: int) -> tuple[bytes, int]:
    """A bitmap over the low bits of ``hashes`` (one bit set per hash, little-endian within each byte) and the
    mask of those bits: a hash whose bit is clear is none of ``hashes``."""
    n_bits = 1 << max(16, int(len(hashes) * bits_per_name - 1).bit_length())
    mask = n_bits - 1
    marks = np.zeros(n_bits, dtype=bool)
    marks[hashes & np.int64(mask)] = True
    return np.packbits(marks, bitorder="little").tobytes(), mask
