# cython: boundscheck=False, wraparound=False, cdivision=True
# (the inline code here compiles into each module that cimports it: with these, as in
# the .pyx beside it, not with Cython's checked defaults)
"""The ranks named on the index's slots and which of them a query looks up, declared
here for the index's query."""

from cpython.object cimport PyObject
from libc.stdint cimport int32_t, uint8_t, uint64_t

from indexer.stores.memory._hybrid cimport HybridWalk
from indexer.stores.memory._tables cimport HolderTable


cdef class RankSlots(HybridWalk):
    # per slot, the rank named on it (NULL: none), its engine, its hash and the chunk
    # size its events taught (0: none): a query resolves only the slots that may match,
    # so its cost follows the ranks holding the chain's start, not the fleet
    cdef PyObject **slot_rank
    cdef PyObject **slot_engine
    cdef Py_hash_t *slot_hash
    cdef Py_ssize_t *slot_learned
    cdef Py_ssize_t named_cap
    cdef dict learned_sizes  # a chunk size taught -> how many named slots learned it
    # per candidate of a query (a listed slot that may match): its slot, chunk size
    # (0: GPU only) and answer (borrowed from the kept answers); the sizes asked
    cdef int32_t *cslot
    cdef Py_ssize_t *csize
    cdef PyObject **cans
    cdef Py_ssize_t *asked
    cdef Py_ssize_t asked_cap
    # the last ``chunk_blocks`` seen, entry by entry (key and value, held): a query
    # passing the same objects in the same order (the same dict, or one built alike
    # from the same registry) keeps what earlier ones resolved, per slot: its declared
    # size (0: none, -1: not listed) as of snapshot ``slot_seen`` (0: never)
    cdef PyObject **snap
    cdef Py_ssize_t snap_n, snap_cap
    cdef uint64_t snap_id
    cdef uint64_t *slot_seen
    cdef Py_ssize_t *slot_declared

    cdef int room(self, Py_ssize_t n) except -1
    cdef int unname(self, Py_ssize_t slot) except -1
    cdef int forget_learned(self, Py_ssize_t slot) except -1
    cdef Py_ssize_t sizes_asked(self, dict chunk_blocks) except -1
    cdef int snapshot(self, dict chunk_blocks) except -1
    cdef void release_snapshot(self) noexcept
    cdef Py_ssize_t ask(self, Py_ssize_t count, Py_ssize_t size) except -1
    cdef int hold_any(self, HolderTable t, Py_ssize_t i, uint64_t *mask) except -1
    cdef Py_ssize_t candidates(
        self, dict chunk_blocks, Py_ssize_t n, Py_ssize_t nsizes, uint8_t *hkind,
    ) except -1
