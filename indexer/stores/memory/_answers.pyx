# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""A query's answers, interned: one shared (immutable) PrefixMatch per distinct set of
fields, kept across queries (most ranks repeat a few answers, query after query)."""

from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.ref cimport Py_DECREF, Py_INCREF
from libc.stdint cimport int64_t, uint64_t
from libc.string cimport memcmp, memcpy, memset

from indexer.stores.memory._keys cimport mix

from indexer.core.matching import NO_MATCH as EMPTY
from indexer.core.matching import PrefixMatch


cdef class Answers:
    """Open addressing over the answers' fields (``kept``: twice ANSWERS_KEPT slots to
    start); the index forgets them all once more than ANSWERS_KEPT are kept."""

    def __cinit__(self):
        self.cap = 2 * ANSWERS_KEPT
        self.kept = <Answer *>PyMem_Malloc(self.cap * sizeof(Answer))
        if not self.kept:
            raise MemoryError()
        memset(self.kept, 0, self.cap * sizeof(Answer))

    def __dealloc__(self):
        self.forget()
        PyMem_Free(self.kept)

    cdef void forget(self) noexcept:
        cdef Py_ssize_t i
        for i in range(self.cap):
            if self.kept[i].obj != NULL:
                Py_DECREF(<object>self.kept[i].obj)
                self.kept[i].obj = NULL
        self.count = 0

    cdef PyObject *answer(self, int64_t *f) except NULL:
        """The one shared (immutable) PrefixMatch with fields ``f``: most ranks repeat a few."""
        cdef uint64_t h = 0
        cdef Py_ssize_t i, k
        if not (f[0] | f[1] | f[2] | f[3]) and f[6] < 0:
            return <PyObject *>EMPTY
        for k in range(FIELDS):
            h = mix(h ^ <uint64_t>f[k])
        i = h & (self.cap - 1)
        while self.kept[i].obj != NULL:
            if memcmp(self.kept[i].f, f, FIELDS * 8) == 0:
                return self.kept[i].obj
            i = (i + 1) & (self.cap - 1)
        if (self.count + 1) * 2 > self.cap:
            self.regrow()
            return self.answer(f)
        match = PrefixMatch(f[0], f[1], f[2], f[3], f[4], f[5], None if f[6] < 0 else f[6])
        Py_INCREF(match)
        memcpy(self.kept[i].f, f, FIELDS * 8)
        self.kept[i].obj = <PyObject *>match
        self.count += 1
        return <PyObject *>match

    cdef int regrow(self) except -1:
        cdef Answer *old = self.kept
        cdef Py_ssize_t n = self.cap, i, j, k
        cdef uint64_t h
        self.kept = <Answer *>PyMem_Malloc(2 * n * sizeof(Answer))
        if not self.kept:
            self.kept = old
            raise MemoryError()
        memset(self.kept, 0, 2 * n * sizeof(Answer))
        self.cap = 2 * n
        for i in range(n):
            if old[i].obj != NULL:
                h = 0
                for k in range(FIELDS):
                    h = mix(h ^ <uint64_t>old[i].f[k])
                j = h & (self.cap - 1)
                while self.kept[j].obj != NULL:
                    j = (j + 1) & (self.cap - 1)
                self.kept[j] = old[i]
        PyMem_Free(old)
        return 0
