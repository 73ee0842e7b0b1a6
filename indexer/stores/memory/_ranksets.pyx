# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Rank sets, interned: one bitset of ``width`` 64-bit words per distinct set of rank
slots, refcounted by the entries naming it.

A hash held by one rank names that rank's singleton, so most entries cost 12 bytes
whatever the number of ranks, and a walk compares runs of one set by id, reading
the words only where it changes. Memory comes from Python's allocator, so
``tracemalloc`` counts it.
"""

from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_Realloc
from libc.stdint cimport uint32_t, uint64_t
from libc.string cimport memcmp, memcpy, memset

from indexer.stores.memory._keys cimport mix


cdef class RankSets:
    """Interned bitsets of rank slots, by id (0: the empty set)."""

    def __cinit__(self):
        self.width, self.cap, self.fresh, self.icap, self.nsingle = 1, 64, 1, 128, 64
        self.words = <uint64_t *>PyMem_Malloc(self.cap * self.width * 8)
        self.sig = <uint64_t *>PyMem_Malloc(self.cap * 8)
        self.refs = <uint32_t *>PyMem_Malloc(self.cap * 4)
        self.spare = <uint32_t *>PyMem_Malloc(self.cap * 4)
        self.index = <uint32_t *>PyMem_Malloc(self.icap * 4)
        self.single = <uint32_t *>PyMem_Malloc(self.nsingle * 4)
        self.scratch = <uint64_t *>PyMem_Malloc(self.width * 8)
        if not (self.words and self.sig and self.refs and self.spare and self.index
                and self.single and self.scratch):
            raise MemoryError()
        memset(self.index, 0, self.icap * 4)
        memset(self.single, 0, self.nsingle * 4)
        memset(self.words, 0, self.width * 8)  # set 0: empty

    def __dealloc__(self):
        PyMem_Free(self.words)
        PyMem_Free(self.sig)
        PyMem_Free(self.refs)
        PyMem_Free(self.spare)
        PyMem_Free(self.index)
        PyMem_Free(self.single)
        PyMem_Free(self.scratch)

    cdef int widen(self, Py_ssize_t slots) except -1:
        """Room for ``slots`` slots in every set (sig ignores zero words: unchanged)."""
        cdef Py_ssize_t width = (slots + 63) // 64, i
        if width <= self.width:
            return 0
        cdef uint64_t *words = <uint64_t *>PyMem_Malloc(self.cap * width * 8)
        cdef uint64_t *scratch = <uint64_t *>PyMem_Realloc(self.scratch, width * 8)
        if not words or not scratch:
            raise MemoryError()
        self.scratch = scratch
        memset(words, 0, self.cap * width * 8)
        for i in range(self.fresh):
            memcpy(words + i * width, self.words + i * self.width, self.width * 8)
        PyMem_Free(self.words)
        self.words, self.width = words, width
        return 0

    cdef uint32_t intern(self, const uint64_t *w) except 0:
        """The id of the set with words ``w``, made if new (refs 0: the caller takes one)."""
        cdef uint64_t h = self.sig_of(w)
        cdef Py_ssize_t m = self.icap - 1, i = mix(h) & m
        cdef uint32_t id
        while self.index[i]:
            id = self.index[i]
            if self.sig[id] == h and memcmp(self.words + id * self.width, w, self.width * 8) == 0:
                return id
            i = (i + 1) & m
        id = self.new_id()
        memcpy(self.words + id * self.width, w, self.width * 8)
        self.sig[id], self.refs[id] = h, 0
        self.index[i] = id
        self.live += 1
        if self.live * 2 > self.icap:
            self.reindex(self.icap * 2)
        return id

    cdef uint32_t new_id(self) except 0:
        if self.nspare:
            self.nspare -= 1
            return self.spare[self.nspare]
        if self.fresh == self.cap:
            self.grow()
        self.fresh += 1
        return <uint32_t>(self.fresh - 1)

    cdef int grow(self) except -1:
        cdef Py_ssize_t cap = self.cap * 2
        cdef void *words = PyMem_Realloc(self.words, cap * self.width * 8)
        if not words:
            raise MemoryError()
        self.words = <uint64_t *>words
        cdef void *sig = PyMem_Realloc(self.sig, cap * 8)
        cdef void *refs = PyMem_Realloc(self.refs, cap * 4) if sig else NULL
        cdef void *spare = PyMem_Realloc(self.spare, cap * 4) if refs else NULL
        if sig:
            self.sig = <uint64_t *>sig
        if refs:
            self.refs = <uint32_t *>refs
        if spare:
            self.spare = <uint32_t *>spare
        if not spare:
            raise MemoryError()
        self.cap = cap
        return 0

    cdef int reindex(self, Py_ssize_t icap) except -1:
        cdef uint32_t *index = <uint32_t *>PyMem_Malloc(icap * 4)
        if not index:
            raise MemoryError()
        memset(index, 0, icap * 4)
        cdef Py_ssize_t i, j, m = icap - 1
        cdef uint32_t id
        for i in range(self.icap):
            id = self.index[i]
            if id:
                j = mix(self.sig[id]) & m
                while index[j]:
                    j = (j + 1) & m
                index[j] = id
        PyMem_Free(self.index)
        self.index, self.icap = index, icap
        return 0

    cdef void drop(self, uint32_t id) noexcept:
        """One reference fewer; a set no entry names leaves the index and its id is reused."""
        self.refs[id] -= 1
        if self.refs[id]:
            return
        cdef Py_ssize_t m = self.icap - 1, i = mix(self.sig[id]) & m, j, home
        while self.index[i] != id:
            i = (i + 1) & m
        j = i
        while True:  # backward-shift deletion: no tombstones
            j = (j + 1) & m
            if not self.index[j]:
                break
            home = mix(self.sig[self.index[j]]) & m
            if (j > i and (home <= i or home > j)) or (j < i and home <= i and home > j):
                self.index[i] = self.index[j]
                i = j
        self.index[i] = 0
        self.live -= 1
        self.spare[self.nspare] = id
        self.nspare += 1

    cdef uint32_t singleton(self, Py_ssize_t slot) except 0:
        """The set of one slot: interned once and pinned (slots are few and reused)."""
        cdef Py_ssize_t n
        if slot >= self.nsingle:
            n = max(slot + 1, 2 * self.nsingle)
            self.single = <uint32_t *>PyMem_Realloc(self.single, n * 4)
            if not self.single:
                raise MemoryError()
            memset(self.single + self.nsingle, 0, (n - self.nsingle) * 4)
            self.nsingle = n
        cdef uint32_t id = self.single[slot]
        if not id:
            memset(self.scratch, 0, self.width * 8)
            self.scratch[slot >> 6] = 1ULL << (slot & 63)
            id = self.single[slot] = self.intern(self.scratch)
            self.refs[id] += 1
        return id

    cdef uint32_t changed(self, uint32_t id, Py_ssize_t slot, bint on) except? 0:
        """The set ``id`` with ``slot`` put in (``on``) or taken out; 0 if that empties it."""
        memcpy(self.scratch, self.words + id * self.width, self.width * 8)
        cdef uint64_t bit = 1ULL << (slot & 63)
        if on:
            self.scratch[slot >> 6] |= bit
        else:
            self.scratch[slot >> 6] &= ~bit
        cdef Py_ssize_t k
        for k in range(self.width):
            if self.scratch[k]:
                return self.intern(self.scratch)
        return 0

    cdef object as_int(self, uint32_t id):
        if self.width == 1:
            return self.words[id]
        cdef bytes raw = (<char *>(self.words + id * self.width))[: self.width * 8]
        return int.from_bytes(raw, "little")
