# cython: boundscheck=False, wraparound=False, cdivision=True
# (the inline code here compiles into each module that cimports it: with these, as in
# the .pyx beside it, not with Cython's checked defaults)
"""Interned rank sets: declared here so the tables, the walk and the index read a set's
words and take, drop and test its slots as C."""

from libc.stdint cimport uint32_t, uint64_t

from indexer.stores.memory._keys cimport mix


cdef class RankSets:
    cdef uint64_t *words  # set id -> its ``width`` words
    cdef uint64_t *sig  # set id -> hash of its words (zero words do not count)
    cdef uint32_t *refs  # set id -> entries naming it (+1 for a pinned singleton)
    cdef uint32_t *index  # open addressing over sig: set ids
    cdef uint32_t *spare  # freed ids
    cdef uint32_t *single  # slot -> its singleton's id (0: none yet)
    cdef uint64_t *scratch
    cdef Py_ssize_t width, cap, fresh, nspare, icap, live, nsingle

    cdef int widen(self, Py_ssize_t slots) except -1
    cdef uint32_t intern(self, const uint64_t *w) except 0
    cdef uint32_t new_id(self) except 0
    cdef int grow(self) except -1
    cdef int reindex(self, Py_ssize_t icap) except -1
    cdef void drop(self, uint32_t id) noexcept
    cdef uint32_t singleton(self, Py_ssize_t slot) except 0
    cdef uint32_t changed(self, uint32_t id, Py_ssize_t slot, bint on) except? 0
    cdef object as_int(self, uint32_t id)

    cdef inline uint64_t sig_of(self, const uint64_t *w) noexcept nogil:
        cdef uint64_t h = 0x9E3779B97F4A7C15ULL
        cdef Py_ssize_t k
        for k in range(self.width):
            if w[k]:
                h ^= mix(w[k] + <uint64_t>k * 0x9E3779B97F4A7C15ULL)
        return h

    cdef inline void take(self, uint32_t id) noexcept nogil:
        self.refs[id] += 1

    cdef inline bint has(self, uint32_t id, Py_ssize_t slot) noexcept nogil:
        return (self.words[id * self.width + (slot >> 6)] >> (slot & 63)) & 1
