# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The ranks on the holder index's slots, and a query's candidates among them.

Per slot the index knows the rank named on it, its engine and the chunk size its
events taught, so a query resolves only the slots that may match: those holding
the chain's first block on GPU or, per chunk size asked, the first chunk's end on
CPU or STORAGE. What a query resolved is kept per slot while the next query's
``chunk_blocks`` has the same entries (compared by identity, in order).
"""

from cpython.dict cimport PyDict_Next
from cpython.mem cimport PyMem_Free, PyMem_Realloc
from cpython.object cimport PyObject, PyObject_Hash
from cpython.ref cimport Py_DECREF, Py_INCREF, Py_XDECREF
from libc.stdint cimport int32_t, uint8_t, uint64_t
from libc.string cimport memset

from indexer.stores.memory._hybrid cimport LONELY, HybridWalk
from indexer.stores.memory._keys cimport KV_CTZ
from indexer.stores.memory._tables cimport HolderTable


cdef extern from "Python.h":
    PyObject *PyDict_GetItemWithError(object, object) except? NULL


cdef class RankSlots(HybridWalk):
    """The walk, the hybrid rule and the ranks on the slots; the holder index
    (:mod:`._holders`) is one."""

    def __cinit__(self):
        self.learned_sizes = {}
        self.snap_id = 1  # the empty snapshot

    def __dealloc__(self):
        cdef Py_ssize_t slot
        for slot in range(self.named_cap):
            Py_XDECREF(self.slot_rank[slot])
            Py_XDECREF(self.slot_engine[slot])
        self.release_snapshot()
        PyMem_Free(self.snap)
        PyMem_Free(self.slot_rank)
        PyMem_Free(self.slot_engine)
        PyMem_Free(self.slot_hash)
        PyMem_Free(self.slot_learned)
        PyMem_Free(self.slot_seen)
        PyMem_Free(self.slot_declared)
        PyMem_Free(self.cslot)
        PyMem_Free(self.csize)
        PyMem_Free(self.cans)
        PyMem_Free(self.asked)

    def name(self, bit: int, rank) -> None:
        """Name ``rank`` as the one on ``bit``'s slot: answers are keyed by it."""
        cdef Py_ssize_t slot = bit.bit_length() - 1, n, was = self.named_cap
        if slot >= was:
            n = max(slot + 1, 2 * was)
            self.slot_rank = <PyObject **>PyMem_Realloc(self.slot_rank, n * sizeof(PyObject *))
            self.slot_engine = <PyObject **>PyMem_Realloc(self.slot_engine,
                                                         n * sizeof(PyObject *))
            self.slot_hash = <Py_hash_t *>PyMem_Realloc(self.slot_hash, n * sizeof(Py_hash_t))
            self.slot_learned = <Py_ssize_t *>PyMem_Realloc(self.slot_learned,
                                                           n * sizeof(Py_ssize_t))
            self.slot_seen = <uint64_t *>PyMem_Realloc(self.slot_seen, n * 8)
            self.slot_declared = <Py_ssize_t *>PyMem_Realloc(self.slot_declared,
                                                            n * sizeof(Py_ssize_t))
            if not (self.slot_rank and self.slot_engine and self.slot_hash
                    and self.slot_learned and self.slot_seen and self.slot_declared):
                raise MemoryError()
            memset(self.slot_rank + was, 0, (n - was) * sizeof(PyObject *))
            memset(self.slot_engine + was, 0, (n - was) * sizeof(PyObject *))
            memset(self.slot_learned + was, 0, (n - was) * sizeof(Py_ssize_t))
            self.named_cap = n
        self.unname(slot)
        engine = rank.engine
        self.slot_hash[slot] = PyObject_Hash(rank)
        Py_INCREF(rank)
        Py_INCREF(engine)
        self.slot_rank[slot], self.slot_engine[slot] = <PyObject *>rank, <PyObject *>engine

    def learned(self, bit: int, size) -> None:
        """The chunk size ``bit``'s rank (named) learned from its events (None: none):
        its size wherever a query declares none for its engine."""
        cdef Py_ssize_t slot = bit.bit_length() - 1
        if slot >= self.named_cap or self.slot_rank[slot] == NULL:
            raise KeyError(bit)
        self.forget_learned(slot)
        if size:
            self.slot_learned[slot] = size
            self.learned_sizes[size] = self.learned_sizes.get(size, 0) + 1

    cdef int unname(self, Py_ssize_t slot) except -1:
        self.forget_learned(slot)
        Py_XDECREF(self.slot_rank[slot])
        Py_XDECREF(self.slot_engine[slot])
        self.slot_rank[slot] = self.slot_engine[slot] = NULL
        self.slot_seen[slot] = 0
        return 0

    cdef int forget_learned(self, Py_ssize_t slot) except -1:
        cdef Py_ssize_t size = self.slot_learned[slot]
        if size:
            if self.learned_sizes[size] == 1:
                del self.learned_sizes[size]
            else:
                self.learned_sizes[size] -= 1
            self.slot_learned[slot] = 0
        return 0

    cdef int room(self, Py_ssize_t n) except -1:
        """The walk's buffers, and beside them the candidates' (one each per slot)."""
        cdef Py_ssize_t rcap = self.rcap
        HybridWalk.room(self, n)
        if self.rcap > rcap:
            self.cslot = <int32_t *>PyMem_Realloc(self.cslot, self.rcap * 4)
            self.csize = <Py_ssize_t *>PyMem_Realloc(self.csize, self.rcap * sizeof(Py_ssize_t))
            self.cans = <PyObject **>PyMem_Realloc(self.cans, self.rcap * sizeof(PyObject *))
        if not (self.cslot and self.csize and self.cans):
            raise MemoryError()
        return 0

    cdef Py_ssize_t sizes_asked(self, dict chunk_blocks) except -1:
        """The distinct chunk sizes ``chunk_blocks`` gives its engines (0: GPU only), those
        learned too where it gives none: every size a listed rank can be matched with."""
        cdef Py_ssize_t pos = 0, count = 0, size, i = 0
        cdef PyObject *key
        cdef PyObject *value
        cdef PyObject *seen = NULL
        cdef PyObject **snap = self.snap
        cdef bint learned = False, same = len(chunk_blocks) == self.snap_n
        while PyDict_Next(chunk_blocks, &pos, &key, &value):
            if same and (snap[2 * i] != key or snap[2 * i + 1] != value):
                same = False
            i += 1
            if value != seen:  # most engines share one size object
                seen = value
                size = <object>value or 0
                if size:
                    count = self.ask(count, size)
                else:
                    learned = True
        if not same:
            self.snapshot(chunk_blocks)
        if learned:
            count = self.ask(count, 0)
            for size in self.learned_sizes:
                count = self.ask(count, size)
        return count

    cdef int snapshot(self, dict chunk_blocks) except -1:
        """Hold ``chunk_blocks``' entries as the snapshot that slots' sizes are kept for."""
        cdef Py_ssize_t pos = 0, n = len(chunk_blocks), i = 0
        cdef PyObject *key
        cdef PyObject *value
        self.release_snapshot()
        if 2 * n > self.snap_cap:
            self.snap_cap = max(2 * n, 2 * self.snap_cap)
            self.snap = <PyObject **>PyMem_Realloc(self.snap, self.snap_cap * sizeof(PyObject *))
            if not self.snap:
                raise MemoryError()
        while PyDict_Next(chunk_blocks, &pos, &key, &value):
            Py_INCREF(<object>key)
            Py_INCREF(<object>value)
            self.snap[2 * i], self.snap[2 * i + 1] = key, value
            i += 1
        self.snap_n = n
        self.snap_id += 1
        return 0

    cdef void release_snapshot(self) noexcept:
        cdef Py_ssize_t i
        for i in range(2 * self.snap_n):
            Py_DECREF(<object>self.snap[i])
        self.snap_n = 0

    cdef Py_ssize_t ask(self, Py_ssize_t count, Py_ssize_t size) except -1:
        cdef Py_ssize_t i
        for i in range(count):
            if self.asked[i] == size:
                return count
        if count == self.asked_cap:
            self.asked_cap = max(8, 2 * self.asked_cap)
            self.asked = <Py_ssize_t *>PyMem_Realloc(self.asked, self.asked_cap * sizeof(Py_ssize_t))
            if not self.asked:
                raise MemoryError()
        self.asked[count] = size
        return count + 1

    cdef int hold_any(self, HolderTable t, Py_ssize_t i, uint64_t *mask) except -1:
        """Add to ``mask`` the slots holding position ``i`` in ``t`` (read() it first)."""
        cdef Py_ssize_t width = self.sets.width, k
        cdef uint64_t *w = self.sets.words + self.lookup(t, i) * width
        for k in range(width):
            mask[k] |= w[k]
        return 0

    cdef Py_ssize_t candidates(
        self, dict chunk_blocks, Py_ssize_t n, Py_ssize_t nsizes, uint8_t *hkind,
    ) except -1:
        """The listed slots that may match something, with their chunk sizes (``cslot``,
        ``csize``; their count returned; their mask left in ``active``).

        A rank holding neither the chain's first block on GPU nor, for its chunk size,
        the first chunk's end on CPU or STORAGE matches nothing: only the slots holding
        one of these few positions (for every size asked), and hybrid ranks walked on
        their own tables, are looked up in ``chunk_blocks``.
        """
        cdef Py_ssize_t width = self.sets.width, k, i, slot, size, count = 0
        cdef uint64_t *cand = self.active
        cdef uint64_t word
        cdef PyObject *found
        cdef PyObject *seen = NULL
        cdef Py_ssize_t seen_size = 0
        memset(cand, 0, width * 8)
        self.read(0)
        self.hold_any(self.gpu, 0, cand)
        for i in range(nsizes):
            size = self.asked[i]
            if 0 < size <= n:
                self.read(size - 1)
                self.hold_any(self.cpu, size - 1, cand)
                self.hold_any(self.storage, size - 1, cand)
        if hkind != NULL:
            for slot in range(min(self.hcap, width * 64)):
                if hkind[slot] == LONELY:
                    cand[slot >> 6] |= 1ULL << (slot & 63)
        for k in range(width):
            word = cand[k]
            while word:
                slot = k * 64 + KV_CTZ(word)
                word &= word - 1
                if slot >= self.named_cap or self.slot_rank[slot] == NULL:
                    cand[k] &= ~(1ULL << (slot & 63))
                    continue
                if self.slot_seen[slot] != self.snap_id:
                    found = PyDict_GetItemWithError(chunk_blocks,
                                                    <object>self.slot_engine[slot])
                    if found != seen and found != NULL:
                        seen, seen_size = found, <object>found or 0
                    self.slot_declared[slot] = -1 if found == NULL else seen_size
                    self.slot_seen[slot] = self.snap_id
                size = self.slot_declared[slot]
                if size < 0:  # not listed
                    cand[k] &= ~(1ULL << (slot & 63))
                    continue
                size = size or self.slot_learned[slot]
                self.cslot[count], self.csize[count] = <int32_t>slot, size
                self.cans[count] = NULL
                count += 1
        return count
