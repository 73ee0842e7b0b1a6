# cython: boundscheck=False, wraparound=False, cdivision=True
# (the inline code here compiles into each module that cimports it: with these, as in
# the .pyx beside it, not with Cython's checked defaults)
"""vLLM's hybrid rule on the window masks, declared here for the index that applies it."""

from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t

from indexer.stores.memory._tables cimport HolderTable
from indexer.stores.memory._walk cimport ChainWalk


cdef enum:
    # how a slot's answer is taken to vLLM's hybrid rule
    FULL_ONLY = 0  # it is not: no window group
    IN_C = 1  # one full-attention and one window group: on the window masks, here
    WALKED = 2  # any other hybrid rank: walked on its own tables, when it matched something
    LONELY = 3  # no full-attention group: walked on its own tables always


cdef class HybridWalk(ChainWalk):
    # the tables the hybrid rule reads, out of the dicts once (a rank's rule ran 5 dict
    # lookups, most of its cost on a short chain)
    cdef HolderTable gpu, cpu, storage, win_gpu, win_cpu, win_storage
    # the chain's window set ids (NO_ID: not read): per block on GPU, then per chunk on
    # CPU and on STORAGE; per slot its hybrid kind, window and block size, as last seen
    cdef uint32_t *wids
    cdef uint8_t *hkind
    cdef int64_t *hwin
    cdef int64_t *hbs
    cdef Py_ssize_t hcap
    cdef object hybrids_seen, generation_seen
    # per call site of window_hit (GPU, CPU, STORAGE, prefix): the last units it asked
    # about and the slots holding all of them (most hybrid ranks end where others do)
    cdef Py_ssize_t memo_lo[4]
    cdef Py_ssize_t memo_hi[4]
    cdef uint64_t *memo_mask
    cdef Py_ssize_t memo_width

    cdef int room(self, Py_ssize_t n) except -1
    cdef bint covered(
        self, Py_ssize_t memo, Py_ssize_t lo, Py_ssize_t hi, HolderTable a, uint32_t *a_ids,
        HolderTable b, uint32_t *b_ids, Py_ssize_t size, Py_ssize_t slot,
    ) except -1
    cdef int hybrid_slots(self, object hybrids) except -1
    cdef Py_ssize_t window_hit(
        self, Py_ssize_t memo, Py_ssize_t need, Py_ssize_t start, Py_ssize_t cap, HolderTable a,
        uint32_t *a_ids, HolderTable b, uint32_t *b_ids, Py_ssize_t size, Py_ssize_t slot,
    ) except -1
    cdef int hybrid_rule(
        self, int64_t *f, Py_ssize_t slot, Py_ssize_t size, Py_ssize_t chunks,
        uint32_t *cpu_ids, uint32_t *storage_ids,
    ) except -1
