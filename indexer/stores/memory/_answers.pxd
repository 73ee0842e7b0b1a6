# cython: boundscheck=False, wraparound=False, cdivision=True
# (the inline code here compiles into each module that cimports it: with these, as in
# the .pyx beside it, not with Cython's checked defaults)
"""The answers a query hands out, declared here for the index that fills them."""

from cpython.object cimport PyObject
from libc.stdint cimport int64_t


cdef enum:
    FIELDS = 7  # PrefixMatch's fields
    ANSWERS_KEPT = 4096  # answer objects kept between queries


ctypedef struct Answer:
    int64_t f[FIELDS]  # a PrefixMatch's fields; the last -1 for None
    PyObject *obj  # NULL: a free slot


cdef class Answers:
    cdef Answer *kept
    cdef Py_ssize_t cap, count

    cdef void forget(self) noexcept
    cdef PyObject *answer(self, int64_t *f) except NULL
    cdef int regrow(self) except -1
