# cython: boundscheck=False, wraparound=False, cdivision=True
# (the inline code here compiles into each module that cimports it: with these, as in
# the .pyx beside it, not with Cython's checked defaults)
"""The prefix walk, declared here so the hybrid rule and the index read a chain's keys
and set ids as C: the steps of one position inline, the walk itself by the vtable."""

from cpython.object cimport PyObject, PyObject_Hash
from libc.stdint cimport int32_t, uint8_t, uint32_t, uint64_t

from indexer.stores.memory._keys cimport KV_SIDE, KV_VALUE, Entry, int_key, mix
from indexer.stores.memory._ranksets cimport RankSets
from indexer.stores.memory._tables cimport HolderTable


cdef enum:
    NO_ID = 0xFFFFFFFF  # a set id not read yet


cdef class ChainWalk:
    cdef RankSets sets
    cdef Py_ssize_t slots  # rank slots handed out (free ones too): bits 0 .. slots - 1
    # the chain being walked: per position its key, mixed key and state (0: not read,
    # 1: an int key, 2: a side key); per rank slot its runs
    cdef uint64_t *wkey
    cdef uint64_t *wmix
    cdef uint8_t *wstate
    cdef uint32_t *ids
    cdef Py_ssize_t wcap
    cdef PyObject **witems
    cdef int32_t *runs  # 3 per slot: GPU run, CPU run, STORAGE run (in chunks)
    cdef uint64_t *active  # 2 x width words: two walks' active slots (first: the candidates)
    cdef Py_ssize_t rcap

    cdef int room(self, Py_ssize_t n) except -1
    cdef int walk(
        self, HolderTable t, Py_ssize_t first, Py_ssize_t stride, Py_ssize_t count,
        uint64_t *active, int32_t *out, uint32_t *ids,
    ) except -1

    cdef inline int read(self, Py_ssize_t i) except -1:
        """Position ``i``'s key, once per query."""
        if self.wstate[i]:
            return 0
        if int_key(self.witems[i], &self.wkey[i]):
            self.wstate[i] = 1
        else:
            self.wkey[i] = <uint64_t>PyObject_Hash(<object>self.witems[i])
            self.wstate[i] = 2
        self.wmix[i] = mix(self.wkey[i])
        return 0

    cdef inline uint32_t lookup(self, HolderTable t, Py_ssize_t i) except? NO_ID:
        """The set id of position ``i`` in ``t`` (0: not there); read() it first."""
        cdef Entry *e = t.entries
        cdef Py_ssize_t j = t.home(self.wmix[i])
        cdef uint64_t key = self.wkey[i]
        if self.wstate[i] == 1:
            while e[j].val:
                if e[j].key == key and not (e[j].val & KV_SIDE):
                    return e[j].val
                j = t.after(j)
            return 0
        while e[j].val:
            if t.same(&e[j], key, self.witems[i]):
                return e[j].val & KV_VALUE
            j = t.after(j)
        return 0

    cdef inline bint holds(self, HolderTable t, uint32_t *ids, Py_ssize_t j, Py_ssize_t size,
                           Py_ssize_t slot) except -1:
        """Whether chunk ``j`` (ending at position (j + 1) * size - 1) is in ``t`` for ``slot``."""
        return self.sets.has(self.id_at(t, ids, j, size), slot)

    cdef inline uint32_t id_at(self, HolderTable t, uint32_t *ids, Py_ssize_t j,
                               Py_ssize_t size) except? NO_ID:
        """The set id of chunk ``j`` in ``t``, read once per query."""
        if ids[j] == NO_ID:
            self.read((j + 1) * size - 1)
            ids[j] = self.lookup(t, (j + 1) * size - 1)
        return ids[j]
