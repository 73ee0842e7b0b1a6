# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The embedded store's holder index in C: block hash -> the rank slots holding it.

Same answers as each rank's own walk by the core's rule
(:meth:`indexer.core.residency.RankResidency.match`, the executable reference, held
to it by ``tests/test_compiled_core.py``), and the compiled core's public face: :class:`HolderIndex` and the per-rank
:class:`~indexer.stores.memory._tables.CountTable` are imported from here.

Its parts, each its own module (a ``.pxd`` declares what the others cimport, so
their calls stay C calls; the walk, the hybrid rule and the slots are each a base
class of the next, :class:`HolderIndex` the last):

- ``_keys.pxd``: a hash's 64-bit key and its mix, and the 12-byte table entry;
- ``_ranksets``: rank sets, interned, one bitset per distinct set, refcounted;
- ``_tables``: the open-addressing tables, ``hash -> rank set`` per medium and
  ``hash -> refcount`` per rank;
- ``_walk``: the prefix walk over a chain, positions prefetched ahead;
- ``_hybrid``: vLLM's hybrid rule on the window masks;
- ``_slots``: the ranks named on the slots, and which of them a query looks up;
- ``_answers``: the PrefixMatch objects handed out, interned across queries;
- here: the index's interface, and the query that ties them.

Memory comes from Python's allocator, so ``tracemalloc`` counts it.
"""

from cpython.object cimport PyObject
from cpython.sequence cimport PySequence_Fast, PySequence_Fast_GET_SIZE, PySequence_Fast_ITEMS
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memcmp, memcpy, memset

from indexer.stores.memory._answers cimport ANSWERS_KEPT, FIELDS, Answers
from indexer.stores.memory._hybrid cimport IN_C, LONELY, WALKED
from indexer.stores.memory._slots cimport RankSlots
from indexer.stores.memory._tables cimport HolderTable

from indexer.core.events import CPU, GPU, MEDIA, STORAGE
from indexer.stores.memory._tables import CountTable  # the per-rank tables, public here
from indexer.core.matching import NO_MATCH as EMPTY


cdef extern from "Python.h":
    dict _PyDict_NewPresized(Py_ssize_t)


cdef extern from *:
    """
    /* Answers go into a dict by the rank's hash, computed once when the rank is named
       (a RankId tuple does not cache its hash). */
    #if PY_VERSION_HEX < 0x030D0000
    #define KV_SET_KNOWN(d, k, v, h) _PyDict_SetItem_KnownHash((d), (k), (v), (h))
    #else
    #define KV_SET_KNOWN(d, k, v, h) PyDict_SetItem((d), (k), (v))
    #endif
    """
    int KV_SET_KNOWN(object d, object k, object v, Py_hash_t h) except -1


cdef class HolderIndex(RankSlots):
    """Per medium, ``hash -> rank set``, walked in C.

    ``media`` and ``windows`` (the window groups of hybrid models' ranks) map each
    medium to its :class:`HolderTable`; a rank's bit is ``1 << slot``.
    """

    cdef readonly dict media
    cdef readonly dict windows
    cdef list free_slots
    cdef Answers answers  # the PrefixMatch objects handed out, kept across queries

    def __cinit__(self):
        self.media = {m: HolderTable(self.sets) for m in MEDIA}
        self.windows = {m: HolderTable(self.sets) for m in MEDIA}
        self.gpu, self.cpu, self.storage = self.media[GPU], self.media[CPU], self.media[STORAGE]
        self.win_gpu, self.win_cpu = self.windows[GPU], self.windows[CPU]
        self.win_storage = self.windows[STORAGE]
        self.free_slots = []
        self.answers = Answers()

    def take_bit(self) -> int:
        """A bit no live rank uses (its hashes were all discarded when it was released)."""
        if self.free_slots:
            return 1 << self.free_slots.pop()
        self.slots += 1
        self.sets.widen(self.slots)
        cdef object one = 1  # a Python int: bits go past 64
        return one << (self.slots - 1)

    def release_bit(self, bit: int) -> None:
        cdef Py_ssize_t slot = bit.bit_length() - 1
        if slot < self.named_cap:
            self.unname(slot)
        self.free_slots.append(slot)

    def add(self, medium, bit, hashes, media=None) -> None:
        """Set ``bit`` on every hash (idempotent); ``media``: :attr:`media` or :attr:`windows`."""
        (<HolderTable>(media or self.media)[medium]).put(bit.bit_length() - 1, hashes, True)

    def discard(self, medium, bit, hashes, media=None) -> None:
        """Clear ``bit`` on every hash (idempotent); a hash no rank holds leaves."""
        (<HolderTable>(media or self.media)[medium]).put(bit.bit_length() - 1, hashes, False)

    def match(self, chain, chunk_blocks, hybrids=None) -> dict:
        """The prefix match of each rank of the engines ``chunk_blocks`` lists that
        matches something (the others are left out), with the chunk size it gives the
        engine, else the one the rank learned (:meth:`learned`; none: GPU only, as with
        one longer than the chain).

        The GPU run of every candidate (:meth:`candidates`) comes from one walk of
        the chain; per chunk size, one walk of the chunk ends on CPU and one on STORAGE
        gives the lower-tier runs; then each rank's prefix is the GPU run extended by
        the chunks after it that a lower tier holds, CPU first (chunks inside its CPU
        run skipped at once). The ranks of ``hybrids`` then have their answers taken
        to vLLM's hybrid rule: a rank with one full-attention and one window group
        here, on the window masks (:meth:`hybrid_rule`); any other by
        :meth:`Hybrids.walk` on its own tables.
        """
        cdef object seq = PySequence_Fast(chain, "chain must be a sequence")
        cdef Py_ssize_t n = PySequence_Fast_GET_SIZE(seq)
        if not n or not self.slots:
            return {}
        if type(chunk_blocks) is not dict:
            chunk_blocks = dict(chunk_blocks)
        if self.answers.count > ANSWERS_KEPT:
            self.answers.forget()
        self.room(n)
        self.witems = PySequence_Fast_ITEMS(seq)
        cdef uint8_t *hkind = NULL
        cdef uint32_t *w_ids = self.wids
        if hybrids is not None:
            self.hybrid_slots(hybrids)
            hkind = self.hkind
            memset(w_ids, 0xFF, n * 4)
        cdef Py_ssize_t nc = self.candidates(chunk_blocks, n, self.sizes_asked(chunk_blocks), hkind)
        if not nc:
            return {}
        cdef Py_ssize_t width = self.sets.width, c, slot, k
        cdef uint64_t *active = self.active
        cdef int32_t *runs = self.runs
        self.walk(self.gpu, 0, 1, n, active, runs, self.ids)
        # every distinct chunk size in turn (there is usually one); 0: GPU only
        cdef Py_ssize_t size = 0, done = 0, chunks, j, prefix, cpu_run, storage_run
        cdef Py_ssize_t *csize = self.csize
        cdef int32_t *cslot = self.cslot
        cdef bint chosen
        cdef HolderTable cpu = self.cpu, storage = self.storage
        cdef uint32_t *cpu_ids = self.ids
        cdef uint32_t *storage_ids = self.ids + self.wcap
        cdef int64_t f[FIELDS]
        cdef int64_t last[FIELDS]  # the last answer's fields: most ranks repeat one or two
        cdef PyObject *last_answer = NULL
        cdef PyObject **ans = self.cans
        cdef PyObject *empty = <PyObject *>EMPTY
        cdef dict out = _PyDict_NewPresized(nc)
        while done < nc:
            chosen = False
            memset(active, 0, width * 8)
            for c in range(nc):
                if ans[c] == NULL and (not chosen or csize[c] == size):
                    size, chosen = csize[c], True
                    slot = cslot[c]
                    active[slot >> 6] |= 1ULL << (slot & 63)
            chunks = n // size if size > 0 else 0
            for k in range(4):  # the window ids are read afresh: so are the memos
                self.memo_hi[k] = -1
            if chunks:
                memset(cpu_ids, 0xFF, chunks * 4)
                memset(storage_ids, 0xFF, chunks * 4)
                memcpy(active + width, active, width * 8)
                if hkind != NULL:
                    memset(w_ids + self.wcap, 0xFF, chunks * 4)
                    memset(w_ids + 2 * self.wcap, 0xFF, chunks * 4)
                self.walk(cpu, size - 1, size, chunks, active, runs + 1, cpu_ids)
                self.walk(storage, size - 1, size, chunks, active + width, runs + 2, storage_ids)
            for c in range(nc):
                if ans[c] != NULL or csize[c] != size:
                    continue
                slot = cslot[c]
                f[0] = f[3] = runs[3 * slot]
                f[1] = f[2] = f[4] = f[5] = 0
                f[6] = -1
                if chunks:
                    cpu_run, storage_run = runs[3 * slot + 1], runs[3 * slot + 2]
                    f[1], f[2] = cpu_run * size, storage_run * size
                    prefix, j = f[0], f[0] // size
                    while j < chunks:
                        if j < cpu_run:  # chunks j .. cpu_run - 1 are all on CPU
                            f[4] += cpu_run * size - prefix
                            prefix, j = cpu_run * size, cpu_run
                            continue
                        if self.holds(cpu, cpu_ids, j, size, slot):
                            f[4] += (j + 1) * size - prefix
                        elif j < storage_run or self.holds(storage, storage_ids, j, size, slot):
                            f[5] += (j + 1) * size - prefix
                        else:
                            break
                        prefix, j = (j + 1) * size, j + 1
                    f[3] = prefix
                if (hkind != NULL and slot < self.hcap and hkind[slot] == IN_C
                        and (f[0] | f[1] | f[2] | f[3])):
                    self.hybrid_rule(f, slot, size, chunks, cpu_ids, storage_ids)
                if last_answer == NULL or memcmp(f, last, FIELDS * 8) != 0:
                    last_answer = self.answers.answer(f)
                    memcpy(last, f, FIELDS * 8)
                ans[c] = last_answer
                done += 1
                if hkind == NULL and last_answer != empty:  # final: no hybrid rule to come
                    self.put_answer(out, slot, last_answer)
        if hkind == NULL:
            return out
        cdef object one = 1
        for c in range(nc):
            slot = cslot[c]
            if slot < self.hcap and (hkind[slot] == LONELY
                                     or (hkind[slot] == WALKED and ans[c] != empty)):
                match = hybrids.walk(one << slot, <object>ans[c], chain, csize[c])
                if match == EMPTY:
                    ans[c] = empty
                else:
                    ans[c] = <PyObject *>match  # held by ``match`` until ``out`` has it
            if ans[c] != empty:
                self.put_answer(out, slot, ans[c])
        return out

    cdef inline int put_answer(self, dict out, Py_ssize_t slot, PyObject *answer) except -1:
        """``slot``'s rank answered ``answer`` in ``out`` (its hash known)."""
        return KV_SET_KNOWN(out, <object>self.slot_rank[slot], <object>answer,
                            self.slot_hash[slot])
