# cython: boundscheck=False, wraparound=False, cdivision=True
# (the inline code here compiles into each module that cimports it: with these, as in
# the .pyx beside it, not with Cython's checked defaults)
"""The key tables, declared here so the walk probes them as C: their entries, and the
inline steps of a probe (a key's home slot, the next slot, a side key's check)."""

from cpython.object cimport PyObject, PyObject_RichCompareBool, Py_EQ
from libc.stdint cimport uint32_t, uint64_t

from indexer.stores.memory._keys cimport KV_HOME, KV_SIDE, KV_VALUE, Entry, Probe
from indexer.stores.memory._ranksets cimport RankSets


cdef class KeyTable:
    cdef Entry *entries
    cdef Py_ssize_t cap, count
    cdef list side  # a side key's place -> the hash (None: free)
    cdef list side_free
    cdef uint64_t *side_hash  # a side key's place -> the hash's Python hash
    cdef Py_ssize_t side_cap

    cdef Py_ssize_t find(self, uint64_t key, PyObject *obj, uint64_t h) except? -2
    cdef Py_ssize_t locate(self, object h, uint64_t *key, PyObject **obj) except? -2
    cdef int probe(self, PyObject *h, Probe *p) except -1
    cdef Py_ssize_t locate_batch(
        self, PyObject **items, Py_ssize_t n, Py_ssize_t k, Probe *ring,
        uint64_t *key, PyObject **obj,
    ) except? -2
    cdef int rehash(self, Py_ssize_t cap) except -1
    cdef Py_ssize_t side_place(self, PyObject *obj, uint64_t key) except -1
    cdef int insert(self, Py_ssize_t free, uint64_t key, PyObject *obj, uint32_t val) except -1
    cdef int remove(self, Py_ssize_t i) except -1
    cdef int compact_side(self) except -1
    cdef object value(self, uint32_t val)

    cdef inline Py_ssize_t home(self, uint64_t mixed) noexcept nogil:
        """Where the probe for a key (``mixed``: its mix()) starts."""
        return KV_HOME(mixed, self.cap)

    cdef inline Py_ssize_t after(self, Py_ssize_t i) noexcept nogil:
        """The slot probed after ``i``: linear probing, wrapping at the capacity."""
        i += 1
        return 0 if i == self.cap else i

    cdef inline uint64_t hashed(self, const Entry *e) noexcept nogil:
        """The key an entry's home comes from: a side key's Python hash, else the key."""
        return self.side_hash[e.key] if e.val & KV_SIDE else e.key

    cdef inline uint32_t val_at(self, Py_ssize_t i) noexcept nogil:
        return self.entries[i].val & KV_VALUE

    cdef inline bint same(self, const Entry *e, uint64_t key, PyObject *obj) except -1:
        if obj == NULL:
            return e.key == key and not (e.val & KV_SIDE)
        if not (e.val & KV_SIDE) or self.side_hash[e.key] != key:
            return False
        cdef object held = self.side[e.key]
        return <PyObject *>held == obj or PyObject_RichCompareBool(held, <object>obj, Py_EQ)

    cdef inline Py_ssize_t found(self, const Probe *p, uint64_t *key, PyObject **obj) except? -2:
        """Where a probed hash is (as find()), its key and object given out."""
        key[0], obj[0] = p.key, p.obj
        return self.find(p.key, p.obj, p.mixed)

    cdef inline object key_at(self, Py_ssize_t i):
        if self.entries[i].val & KV_SIDE:
            return self.side[self.entries[i].key]
        return self.entries[i].key


cdef class HolderTable(KeyTable):
    cdef RankSets sets

    cdef int put(self, Py_ssize_t slot, object hashes, bint on) except -1
