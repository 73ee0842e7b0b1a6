# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Open-addressing tables over block hashes: a medium's ``hash -> rank set``
(:class:`HolderTable`) and a rank's ``hash -> refcount`` (:class:`CountTable`).

Linear probing, backward-shift deletion, 12-byte entries: the 64-bit key and a
32-bit value whose top bit says what the key is (``_keys.pxd``). A key's slot is
its mixed bits multiplied onto the capacity (the high word), so a table can have
any size: it grows by half past 80% full, and stays 53-80% full (doubling at 3/4
left it 37-75% full, bytes per entry swinging 2x with the fleet's size; at 85% a
linear probe's misses grew long: a 10M-entry fill took 10-30% more CPU). A batch
of updates (a rank's counts, its bits) prefetches a few hashes ahead, so a table
past the cache overlaps the batch's misses. Memory comes from Python's allocator,
so ``tracemalloc`` counts it.
"""

from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_Realloc
from cpython.object cimport PyObject, PyObject_Hash
from cpython.sequence cimport PySequence_Fast, PySequence_Fast_GET_SIZE, PySequence_Fast_ITEMS
from libc.stdint cimport uint32_t, uint64_t
from libc.string cimport memset

from indexer.stores.memory._keys cimport KV_PREFETCH, KV_SIDE, Entry, Probe, int_key, mix
from indexer.stores.memory._ranksets cimport RankSets


cdef enum:
    # a key table grows past LOAD_NUM / LOAD_DEN full, by GROW_NUM / GROW_DEN: it stays
    # between their quotient and that load
    LOAD_NUM = 4
    LOAD_DEN = 5
    GROW_NUM = 3
    GROW_DEN = 2
    # and halves below 1 / SHRINK_DEN full (to twice that load, under the growth's),
    # down to SHRINK_FLOOR slots: a rank cleared or an attack over gives its room back
    SHRINK_DEN = 5
    SHRINK_FLOOR = 64
    BATCH_AHEAD = 16  # hashes of a batch prefetched ahead of their update (a power of 2)


cdef class KeyTable:
    """Open addressing over the hashes of one tier or medium: ``hash -> value``.

    Reads like the ``dict`` of the reference it replaces (``get``, ``in``, ``len``,
    iteration, ``items``, equality with a dict); what the value is, the subclass says.
    """

    def __cinit__(self, *args):
        self.cap, self.count = 8, 0
        self.entries = <Entry *>PyMem_Malloc(self.cap * sizeof(Entry))
        if not self.entries:
            raise MemoryError()
        memset(self.entries, 0, self.cap * sizeof(Entry))
        self.side, self.side_free = [], []

    def __dealloc__(self):
        PyMem_Free(self.entries)
        PyMem_Free(self.side_hash)

    cdef Py_ssize_t find(self, uint64_t key, PyObject *obj, uint64_t h) except? -2:
        """Where the hash is (or -1 - the free slot where it would go)."""
        cdef Py_ssize_t i = self.home(h)
        while self.entries[i].val:
            if self.same(&self.entries[i], key, obj):
                return i
            i = self.after(i)
        return -1 - i

    cdef Py_ssize_t locate(self, object h, uint64_t *key, PyObject **obj) except? -2:
        cdef Probe p
        self.probe(<PyObject *>h, &p)
        return self.found(&p, key, obj)

    cdef int probe(self, PyObject *h, Probe *p) except -1:
        """A hash's key (itself for an int below 2**64, else its Python hash, ``obj``
        kept) and mix; its home slot is prefetched."""
        if int_key(h, &p.key):
            p.obj = NULL
        else:
            p.key = <uint64_t>PyObject_Hash(<object>h)
            p.obj = h
        p.mixed = mix(p.key)
        KV_PREFETCH(&self.entries[self.home(p.mixed)])
        return 0

    cdef Py_ssize_t locate_batch(
        self, PyObject **items, Py_ssize_t n, Py_ssize_t k, Probe *ring,
        uint64_t *key, PyObject **obj,
    ) except? -2:
        """locate() of ``items[k]``, for k = 0, 1, ... n - 1 in turn (``ring``: BATCH_AHEAD
        probes). A table past the cache costs a miss per hash: probing BATCH_AHEAD hashes
        ahead overlaps a batch's misses. Only the mix is kept, never a slot, so an
        update or a rehash between a probe and its use costs at most a wasted prefetch."""
        cdef Py_ssize_t j
        if k == 0:
            for j in range(min(<Py_ssize_t>BATCH_AHEAD, n)):
                self.probe(items[j], &ring[j])
        cdef Probe p = ring[k & (BATCH_AHEAD - 1)]
        if k + BATCH_AHEAD < n:
            self.probe(items[k + BATCH_AHEAD], &ring[k & (BATCH_AHEAD - 1)])
        return self.found(&p, key, obj)

    cdef int rehash(self, Py_ssize_t cap) except -1:
        cdef Entry *old = self.entries
        cdef Py_ssize_t n = self.cap, i, j
        self.entries = <Entry *>PyMem_Malloc(cap * sizeof(Entry))
        if not self.entries:
            self.entries = old
            raise MemoryError()
        memset(self.entries, 0, cap * sizeof(Entry))
        self.cap = cap
        for i in range(n):
            if old[i].val:
                j = self.home(mix(self.hashed(&old[i])))
                while self.entries[j].val:
                    j = self.after(j)
                self.entries[j] = old[i]
        PyMem_Free(old)
        return 0

    cdef Py_ssize_t side_place(self, PyObject *obj, uint64_t key) except -1:
        """Where the side list keeps hash ``obj`` (``key``: its Python hash)."""
        cdef Py_ssize_t place, n
        cdef void *grown
        if self.side_free:
            place = self.side_free.pop()
            self.side[place] = <object>obj
        else:
            place = len(self.side)
            if place == self.side_cap:
                n = max(8, 2 * self.side_cap)
                grown = PyMem_Realloc(self.side_hash, n * 8)
                if not grown:
                    raise MemoryError()
                self.side_hash, self.side_cap = <uint64_t *>grown, n
            self.side.append(<object>obj)
        self.side_hash[place] = key
        return place

    cdef int insert(self, Py_ssize_t free, uint64_t key, PyObject *obj, uint32_t val) except -1:
        """Hold a new hash at ``free``, the free slot find() gave (sought again on growth)."""
        cdef uint64_t stored = key
        if obj != NULL:
            stored = <uint64_t>self.side_place(obj, key)
            val |= KV_SIDE
        if (self.count + 1) * LOAD_DEN > self.cap * LOAD_NUM:
            self.rehash(self.cap * GROW_NUM // GROW_DEN)
            free = -1 - self.find(key, obj, mix(key))
        self.entries[free].key, self.entries[free].val = stored, val
        self.count += 1
        return 0

    cdef int remove(self, Py_ssize_t i) except -1:
        if self.entries[i].val & KV_SIDE:
            self.side[self.entries[i].key] = None
            self.side_free.append(self.entries[i].key)
        cdef Py_ssize_t j = i, home
        while True:  # backward-shift deletion: no tombstones
            j = self.after(j)
            if not self.entries[j].val:
                break
            home = self.home(mix(self.hashed(&self.entries[j])))
            if (j > i and (home <= i or home > j)) or (j < i and home <= i and home > j):
                self.entries[i] = self.entries[j]
                i = j
        self.entries[i].val = 0
        self.count -= 1
        if self.cap > SHRINK_FLOOR and self.count * SHRINK_DEN < self.cap:
            self.rehash(self.cap // 2)
            self.compact_side()
        return 0

    cdef int compact_side(self) except -1:
        """Renumber the side list's places densely, so its free places are let go too
        (a table shrunk after holding many non-int hashes would keep their list)."""
        if not self.side_free:
            return 0
        cdef list side = []
        cdef Py_ssize_t live = max(1, len(self.side) - len(self.side_free))
        cdef uint64_t *hashes = <uint64_t *>PyMem_Malloc(live * 8)
        if not hashes:
            raise MemoryError()
        cdef Py_ssize_t i, place
        for i in range(self.cap):
            if self.entries[i].val & KV_SIDE:
                place = len(side)
                side.append(self.side[self.entries[i].key])
                hashes[place] = self.side_hash[self.entries[i].key]
                self.entries[i].key = place
        PyMem_Free(self.side_hash)
        self.side, self.side_free = side, []
        self.side_hash, self.side_cap = hashes, live
        return 0

    cdef object value(self, uint32_t val):
        return val

    def get(self, h, default=None):
        cdef uint64_t key
        cdef PyObject *obj
        cdef Py_ssize_t i = self.locate(h, &key, &obj)
        return default if i < 0 else self.value(self.val_at(i))

    def __getitem__(self, h):
        found = self.get(h)
        if found is None:
            raise KeyError(h)
        return found

    def __contains__(self, h) -> bool:
        cdef uint64_t key
        cdef PyObject *obj
        return self.locate(h, &key, &obj) >= 0

    def __len__(self) -> int:
        return self.count

    def items(self) -> list:
        cdef Py_ssize_t i
        return [
            (self.key_at(i), self.value(self.val_at(i)))
            for i in range(self.cap)
            if self.entries[i].val
        ]

    def keys(self) -> list:
        cdef Py_ssize_t i
        return [self.key_at(i) for i in range(self.cap) if self.entries[i].val]

    def __iter__(self):
        return iter(self.keys())

    def __eq__(self, other) -> bool:
        if isinstance(other, KeyTable):
            other = dict(other.items())
        return isinstance(other, dict) and dict(self.items()) == other

    def __repr__(self) -> str:
        return f"{type(self).__name__}({dict(self.items())!r})"


cdef class HolderTable(KeyTable):
    """One medium's ``hash -> rank mask`` (bit ``1 << slot`` per rank), as rank set ids."""

    def __cinit__(self, RankSets sets):
        self.sets = sets

    cdef object value(self, uint32_t val):
        return self.sets.as_int(val)

    cdef int put(self, Py_ssize_t slot, object hashes, bint on) except -1:
        """Put ``slot`` into (``on``) or out of every hash's set; a hash no slot holds leaves.

        Runs of hashes share a set (a prompt several ranks hold): the last change
        is remembered, its two sets held so their ids cannot be reused meanwhile.
        """
        cdef object seq = PySequence_Fast(hashes, "hashes must be iterable")
        cdef PyObject **items = PySequence_Fast_ITEMS(seq)
        cdef Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), k, i
        cdef uint64_t key
        cdef PyObject *obj
        cdef uint32_t old, new, was = 0, now = 0
        cdef RankSets sets = self.sets
        cdef Probe ring[BATCH_AHEAD]
        try:
            for k in range(n):
                i = self.locate_batch(items, n, k, ring, &key, &obj)
                if i < 0:
                    if on:
                        new = sets.singleton(slot)
                        sets.take(new)
                        self.insert(-1 - i, key, obj, new)
                    continue
                old = self.val_at(i)
                if sets.has(old, slot) == on:
                    continue
                if old != was:
                    new = sets.changed(old, slot, on)
                    sets.take(old)  # held before the last pair is let go: it may be new
                    if new:
                        sets.take(new)
                    if was:
                        sets.drop(was)
                        if now:
                            sets.drop(now)
                    was, now = old, new
                new = now
                if new:
                    sets.take(new)
                    self.entries[i].val = new | (self.entries[i].val & KV_SIDE)
                else:
                    self.remove(i)
                sets.drop(old)
        finally:
            if was:
                sets.drop(was)
                if now:
                    sets.drop(now)
        return 0

cdef class CountTable(KeyTable):
    """One tier's ``hash -> refcount`` of one rank, for the reference's ``dict[hash, int]``."""

    def add(self, hashes) -> list:
        """One more reference per hash (a hash listed twice gets two); returns the
        hashes this gave their first reference."""
        cdef object seq = PySequence_Fast(hashes, "hashes must be iterable")
        cdef PyObject **items = PySequence_Fast_ITEMS(seq)
        cdef Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), k, i
        cdef uint64_t key
        cdef PyObject *obj
        cdef list fresh = []
        cdef Probe ring[BATCH_AHEAD]
        for k in range(n):
            i = self.locate_batch(items, n, k, ring, &key, &obj)
            if i >= 0:
                self.entries[i].val += 1
            else:
                self.insert(-1 - i, key, obj, 1)
                fresh.append(<object>items[k])
        return fresh

    def drop(self, hashes) -> tuple:
        """One reference fewer per hash, never below zero: a hash leaves with its last.
        Returns the removals of hashes not held, and the hashes that left."""
        cdef object seq = PySequence_Fast(hashes, "hashes must be iterable")
        cdef PyObject **items = PySequence_Fast_ITEMS(seq)
        cdef Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), k, i, unknown = 0
        cdef uint64_t key
        cdef PyObject *obj
        cdef list gone = []
        cdef Probe ring[BATCH_AHEAD]
        for k in range(n):
            i = self.locate_batch(items, n, k, ring, &key, &obj)
            if i < 0:
                unknown += 1
            elif self.val_at(i) > 1:
                self.entries[i].val -= 1
            else:
                self.remove(i)
                gone.append(<object>items[k])
        return unknown, gone
