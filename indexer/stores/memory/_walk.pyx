# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The prefix walk: how far along a chain each rank slot holds it in one table.

A chain's hashes are all known before the walk, so the walk computes the slot of
a position a few positions ahead and prefetches it: the misses of a walk overlap,
where a tree pays one dependent miss per position. Runs of positions held by the
same rank set are compared by the set's id, its words read only where it changes.
"""

from cpython.mem cimport PyMem_Free, PyMem_Realloc
from libc.stdint cimport int32_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memset

from indexer.stores.memory._keys cimport KV_CTZ, KV_PREFETCH
from indexer.stores.memory._ranksets cimport RankSets
from indexer.stores.memory._tables cimport HolderTable


cdef enum:
    LOOKAHEAD = 16  # positions prefetched ahead of a walk


cdef class ChainWalk:
    """A chain's keys and set ids, read once per query, and the walks over them; the
    holder index (:mod:`._holders`) is one."""

    def __cinit__(self):
        self.sets = RankSets()

    def __dealloc__(self):
        PyMem_Free(self.wkey)
        PyMem_Free(self.wmix)
        PyMem_Free(self.wstate)
        PyMem_Free(self.ids)
        PyMem_Free(self.runs)
        PyMem_Free(self.active)

    cdef int room(self, Py_ssize_t n) except -1:
        """Buffers for a chain of ``n`` and for every slot (a subclass grows its own
        beside them, when ``wcap`` or ``rcap`` grows)."""
        if n > self.wcap:
            self.wcap = max(n, 2 * self.wcap)
            self.wkey = <uint64_t *>PyMem_Realloc(self.wkey, self.wcap * 8)
            self.wmix = <uint64_t *>PyMem_Realloc(self.wmix, self.wcap * 8)
            self.wstate = <uint8_t *>PyMem_Realloc(self.wstate, self.wcap)
            self.ids = <uint32_t *>PyMem_Realloc(self.ids, 2 * self.wcap * 4)
        if self.slots > self.rcap:
            self.rcap = max(self.slots, 2 * self.rcap)
            self.runs = <int32_t *>PyMem_Realloc(self.runs, 3 * self.rcap * 4)
            self.active = <uint64_t *>PyMem_Realloc(self.active, 2 * ((self.rcap + 63) // 64) * 8)
        if not (self.wkey and self.wmix and self.wstate and self.ids and self.runs
                and self.active):
            raise MemoryError()
        memset(self.wstate, 0, n)
        return 0

    cdef int walk(
        self, HolderTable t, Py_ssize_t first, Py_ssize_t stride, Py_ssize_t count,
        uint64_t *active, int32_t *out, uint32_t *ids,
    ) except -1:
        """For each slot of ``active``: how many of positions first, first + stride, ...
        (``count`` of them) hold it, from the start (``out[3 * slot]``). Set ids read
        are kept in ``ids`` (others stay NO_ID). ``active`` is consumed."""
        cdef RankSets sets = self.sets
        cdef Py_ssize_t width = sets.width, j, k, p, ahead = min(LOOKAHEAD, count)
        cdef uint32_t id, last = NO_ID
        cdef uint64_t *w
        cdef uint64_t gone, left
        if t.count:
            for j in range(ahead):
                p = first + j * stride
                self.read(p)
                KV_PREFETCH(&t.entries[t.home(self.wmix[p])])
            j = 0
            while j < count:
                if j + ahead < count:
                    p = first + (j + ahead) * stride
                    self.read(p)
                    KV_PREFETCH(&t.entries[t.home(self.wmix[p])])
                id = self.lookup(t, first + j * stride)
                ids[j] = id
                if id != last:
                    last = id
                    w = sets.words + id * width
                    left = 0
                    for k in range(width):
                        gone = active[k] & ~w[k]
                        while gone:
                            out[3 * (k * 64 + KV_CTZ(gone))] = <int32_t>j
                            gone &= gone - 1
                        active[k] &= w[k]
                        left |= active[k]
                    if not left:
                        return 0
                j += 1
        else:
            count = 0
        for k in range(width):
            gone = active[k]
            while gone:
                out[3 * (k * 64 + KV_CTZ(gone))] = <int32_t>count
                gone &= gone - 1
        return 0
