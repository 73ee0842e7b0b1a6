# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""vLLM's hybrid rule in C for the common hybrid rank (one full-attention and one
window group): its full-attention answer lowered to what its window group holds,
read on the window masks (the index's ``windows`` tables).

Any other hybrid rank is walked by :meth:`~indexer.stores.memory.hybrids.Hybrids.walk`
on its own tables.
"""

from cpython.mem cimport PyMem_Free, PyMem_Realloc
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memset

from indexer.stores.memory._tables cimport HolderTable
from indexer.stores.memory._walk cimport ChainWalk


cdef class HybridWalk(ChainWalk):
    """The walk and, per slot, its hybrid kind; the holder index (:mod:`._holders`) is one."""

    def __dealloc__(self):
        PyMem_Free(self.wids)
        PyMem_Free(self.hkind)
        PyMem_Free(self.hwin)
        PyMem_Free(self.hbs)
        PyMem_Free(self.memo_mask)

    cdef int room(self, Py_ssize_t n) except -1:
        """The walk's buffers, and beside them the chain's window ids (3 per position) and
        the memo masks (4 per word of a rank set)."""
        cdef Py_ssize_t wcap = self.wcap
        ChainWalk.room(self, n)
        if self.wcap > wcap:
            self.wids = <uint32_t *>PyMem_Realloc(self.wids, 3 * self.wcap * 4)
        if self.sets.width > self.memo_width:
            self.memo_width = self.sets.width
            self.memo_mask = <uint64_t *>PyMem_Realloc(self.memo_mask, 4 * self.memo_width * 8)
        if not (self.wids and self.memo_mask):
            raise MemoryError()
        return 0

    cdef bint covered(
        self, Py_ssize_t memo, Py_ssize_t lo, Py_ssize_t hi, HolderTable a, uint32_t *a_ids,
        HolderTable b, uint32_t *b_ids, Py_ssize_t size, Py_ssize_t slot,
    ) except -1:
        """Whether ``slot`` holds every unit of ``[lo, hi)`` in ``a`` or ``b``. The slots
        that do are computed once for all ranks asking ``memo`` about the same units."""
        cdef Py_ssize_t width = self.sets.width, k, u
        cdef uint64_t *mask = self.memo_mask + memo * width
        cdef uint64_t *words = self.sets.words
        cdef uint32_t ia, ib
        if self.memo_lo[memo] != lo or self.memo_hi[memo] != hi:
            for k in range(width):
                mask[k] = ~0ULL
            for u in range(lo, hi):
                ia = self.id_at(a, a_ids, u, size)
                ib = 0 if b is None else self.id_at(b, b_ids, u, size)
                for k in range(width):
                    mask[k] &= words[ia * width + k] | words[ib * width + k]
            self.memo_lo[memo], self.memo_hi[memo] = lo, hi
        return (mask[slot >> 6] >> (slot & 63)) & 1

    cdef int hybrid_slots(self, object hybrids) except -1:
        """Each slot's hybrid kind (IN_C, WALKED, LONELY), window and block size, read
        again from ``hybrids`` only when its ranks changed (its ``generation``)."""
        generation = hybrids.generation
        if hybrids is self.hybrids_seen and generation == self.generation_seen:
            return 0
        cdef Py_ssize_t n = max(self.slots, 1), slot
        if n > self.hcap:
            self.hkind = <uint8_t *>PyMem_Realloc(self.hkind, n)
            self.hwin = <int64_t *>PyMem_Realloc(self.hwin, n * 8)
            self.hbs = <int64_t *>PyMem_Realloc(self.hbs, n * 8)
            if not (self.hkind and self.hwin and self.hbs):
                raise MemoryError()
            self.hcap = n
        memset(self.hkind, FULL_ONLY, self.hcap)
        simple = 0
        for rule, bits in hybrids.simple.items():
            simple |= bits
            while bits:
                low = bits & -bits
                bits ^= low
                slot = low.bit_length() - 1
                self.hkind[slot] = IN_C
                self.hwin[slot], self.hbs[slot] = rule.window, rule.block_size
        rest = hybrids.bits & ~simple
        while rest:
            low = rest & -rest
            rest ^= low
            self.hkind[low.bit_length() - 1] = LONELY if hybrids.unanchored & low else WALKED
        self.hybrids_seen, self.generation_seen = hybrids, generation
        return 0

    cdef Py_ssize_t window_hit(
        self, Py_ssize_t memo, Py_ssize_t need, Py_ssize_t start, Py_ssize_t cap, HolderTable a,
        uint32_t *a_ids, HolderTable b, uint32_t *b_ids, Py_ssize_t size, Py_ssize_t slot,
    ) except -1:
        """A window group's hit over units ``[start, cap)`` (blocks: ``size`` 1; else
        chunks), held in ``a`` or ``b`` (None: ``a`` alone): scanning right to left from
        the cap, the end of the rightmost run of ``need`` held units, else the run held
        from ``start``; the cap lowered to it until it stays. When the units just below the cap are all
        held (``memo``: see :meth:`covered`), the cap is the hit."""
        cdef Py_ssize_t hit = cap, low, unit, run
        if cap > start and self.covered(memo, max(start, cap - need), cap, a, a_ids, b, b_ids,
                                        size, slot):
            return cap
        while hit > start:
            low, run, unit = -1, 0, hit - 1
            while unit >= start:
                if self.holds(a, a_ids, unit, size, slot) or (
                    b is not None and self.holds(b, b_ids, unit, size, slot)
                ):
                    run += 1
                    if run == need:
                        low = unit + need
                        break
                else:
                    run = 0
                unit -= 1
            if low < 0:
                low = start + run
            if low == hit:
                break
            hit = low
        return max(hit, start)

    cdef int hybrid_rule(
        self, int64_t *f, Py_ssize_t slot, Py_ssize_t size, Py_ssize_t chunks,
        uint32_t *cpu_ids, uint32_t *storage_ids,
    ) except -1:
        """``f``, the full-attention answer of a rank with one window group, taken to
        vLLM's hybrid rule on the window masks. GPU: the window group's hit below the
        full-attention run (which that hit cannot lower: the one pass is the fixed
        point). Lower tiers, in chunks: each tier's hit below its full-attention run;
        the prefix from the chunk holding the GPU hit's end, as far as the
        full-attention group holds the chunks on CPU or STORAGE (past the GPU run: its
        prefix), lowered by the window group's hit over both; a prefix chunk is taken
        from CPU when the full-attention group holds it there."""
        cdef int64_t window = self.hwin[slot], bs = self.hbs[slot], full = f[0], past = f[3]
        cdef Py_ssize_t need = 1 if window == 0 else max(1, (window - 1 + bs - 1) // bs)
        cdef HolderTable cpu = self.cpu, storage = self.storage
        cdef Py_ssize_t gpu = self.window_hit(0, need, 0, full, self.win_gpu, self.wids,
                                              None, NULL, 1, slot)
        f[6] = full if full != gpu else -1
        f[0] = f[3] = gpu
        if not chunks:
            return 0
        cdef HolderTable w_cpu = self.win_cpu, w_storage = self.win_storage
        cdef uint32_t *w_cpu_ids = self.wids + self.wcap
        cdef uint32_t *w_storage_ids = self.wids + 2 * self.wcap
        need = 1 if window == 0 else (window + size * bs - 1) // (size * bs)
        f[1] = size * self.window_hit(1, need, 0, f[1] // size, w_cpu, w_cpu_ids, None, NULL,
                                      size, slot)
        f[2] = size * self.window_hit(2, need, 0, f[2] // size, w_storage, w_storage_ids, None,
                                      NULL, size, slot)
        cdef Py_ssize_t first = gpu // size, stop = full // size, reach = first, j
        while reach < stop and (self.holds(cpu, cpu_ids, reach, size, slot)
                                or self.holds(storage, storage_ids, reach, size, slot)):
            reach += 1
        if reach == stop:
            reach = past // size
        cdef Py_ssize_t end = self.window_hit(3, need, first, reach, w_cpu, w_cpu_ids, w_storage,
                                              w_storage_ids, size, slot)
        f[3] = max(gpu, end * size)
        f[4] = 0
        if end > first:
            for j in range(first, end):
                if self.holds(cpu, cpu_ids, j, size, slot):
                    f[4] += size
            if self.holds(cpu, cpu_ids, first, size, slot):  # partly on GPU
                f[4] -= gpu - first * size
        f[5] = f[3] - gpu - f[4]
        return 0
