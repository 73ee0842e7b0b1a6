# cython: boundscheck=False, wraparound=False, cdivision=True
# (the inline code here compiles into each module that cimports it: with these, as in
# the .pyx beside it, not with Cython's checked defaults)
"""What every part of the compiled holder index keys by: a hash's 64-bit key, its mix,
the slot of a mixed key, and the 12-byte entry a key table holds.

An int hash below 2**64 is its own key; any other hash (raw digest bytes) is kept
in a key table's side list, with its Python hash beside it, and keyed by its place
there (compared on every hit), so a bytes hash never meets an int of the same bits.
Inline here (no module behind it), so each part calls them as its own C.
"""

from cpython.long cimport PyLong_Check
from cpython.object cimport PyObject
from libc.stdint cimport uint32_t, uint64_t


cdef extern from "Python.h":
    PyObject *PyErr_Occurred()
    void PyErr_Clear()


cdef extern from *:
    """
    /* PyLong_AsUnsignedLongLong goes through _PyLong_AsByteArray: 3x slower per key
       than PyLong_AsUnsignedLong's digit loop, the same where unsigned long is 64 bits. */
    #include <limits.h>
    #if ULONG_MAX == 0xFFFFFFFFFFFFFFFFUL
    #define KV_AS_U64(o) PyLong_AsUnsignedLong(o)
    #else
    #define KV_AS_U64(o) PyLong_AsUnsignedLongLong(o)
    #endif
    #define KV_PREFETCH(p) __builtin_prefetch((p), 0, 1)
    #define KV_CTZ(x) __builtin_ctzll(x)
    /* A key table's slot of a mixed key: multiply-high maps it onto any capacity, so a
       table grows by GROW_NUM / GROW_DEN, not by doubling. */
    #define KV_HOME(mixed, cap) ((Py_ssize_t)(((unsigned __int128)(mixed) * (uint64_t)(cap)) >> 64))
    #define KV_SIDE 0x80000000u
    #define KV_VALUE 0x7FFFFFFFu
    """
    unsigned long long KV_AS_U64(PyObject *o)
    void KV_PREFETCH(const void *p) nogil
    int KV_CTZ(uint64_t x) nogil
    Py_ssize_t KV_HOME(uint64_t mixed, Py_ssize_t cap) nogil
    # an entry's val bit: its key is the hash's place in the side list, not the hash
    const uint32_t KV_SIDE
    const uint32_t KV_VALUE  # the rest of val


ctypedef packed struct Entry:
    uint64_t key  # the hash itself, or (KV_SIDE) its place in the side list
    uint32_t val  # a rank set's id or a refcount, and KV_SIDE; 0: a free slot


ctypedef struct Probe:
    uint64_t key  # as locate() gives it
    PyObject *obj
    uint64_t mixed  # mix(key)


cdef inline uint64_t mix(uint64_t k) nogil:
    """A full-avalanche 64-bit mix: small or sequential keys spread too."""
    k ^= k >> 33
    k *= 0xFF51AFD7ED558CCDULL
    k ^= k >> 33
    k *= 0xC4CEB9FE1A85EC53ULL
    k ^= k >> 33
    return k


cdef inline bint int_key(PyObject *h, uint64_t *key):
    """True (and the key) for an int in [0, 2**64): the only hashes keyed by their value."""
    if not PyLong_Check(<object>h):
        return False
    cdef unsigned long long v = KV_AS_U64(h)
    if v == <unsigned long long>-1 and PyErr_Occurred() != NULL:
        PyErr_Clear()
        return False
    key[0] = v
    return True
