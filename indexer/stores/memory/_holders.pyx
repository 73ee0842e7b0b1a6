# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The embedded store's holder index in C: block hash -> the rank slots holding it.

Same interface and answers as :class:`indexer.stores.memory.holders.HolderIndex`
(the executable reference, held to it by ``tests/test_compiled_core.py``).

Layout, chosen for the query pattern (one chain, every rank at once):

- Per medium an open-addressing table (linear probing, backward-shift deletion)
  of 12-byte entries: the 64-bit key and a 32-bit value (the id of its rank set)
  whose top bit says what the key is. An int hash below 2**64 is its own key;
  any other hash (raw digest bytes) is kept in a side list, with its Python hash
  beside it, and keyed by its place there (compared on every hit), so a bytes
  hash never meets an int of the same bits. A key's slot is its mixed bits
  multiplied onto the capacity (the high word), so a table can have any size:
  it grows by half past 80% full, and stays 53-80% full (doubling at 3/4 left
  it 37-75% full, bytes per entry swinging 2x with the fleet's size; at 85% a
  linear probe's misses grew long: a 10M-entry fill took 10-30% more CPU).
- Rank sets are interned: one bitset of ``width`` 64-bit words per distinct set,
  refcounted by the entries naming it. A hash held by one rank names that rank's
  singleton, so most entries cost 12 bytes whatever the number of ranks, and a
  walk compares runs of one set by id, reading the words only where it changes.
- A chain's hashes are all known before the walk, so the walk computes the slot
  of a position a few positions ahead and prefetches it: the misses of a walk
  overlap, where a tree pays one dependent miss per position. A batch of updates
  (a rank's counts, its bits) prefetches a few hashes ahead the same way.
- A query costs what the ranks holding the chain's start cost, not the fleet: the
  index knows each slot's rank and learned chunk size, only the slots holding the
  first block on GPU (or, per chunk size asked, the first chunk's end on CPU or
  STORAGE) are looked up in ``chunk_blocks``, and a rank matching nothing is left
  out of the answer. What was looked up is kept per slot while the next query's
  ``chunk_blocks`` has the same entries (compared by identity, in order).

Memory comes from Python's allocator, so ``tracemalloc`` counts it.
"""

from cpython.dict cimport PyDict_Next
from cpython.long cimport PyLong_Check
from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_Realloc
from cpython.object cimport PyObject, PyObject_Hash, PyObject_RichCompareBool, Py_EQ
from cpython.ref cimport Py_DECREF, Py_INCREF, Py_XDECREF
from cpython.sequence cimport PySequence_Fast, PySequence_Fast_GET_SIZE, PySequence_Fast_ITEMS
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memcmp, memcpy, memset

from indexer.core.events import CPU, GPU, MEDIA, STORAGE
from indexer.core.matching import PrefixMatch
from indexer.stores.memory.walk import EMPTY


cdef extern from "Python.h":
    PyObject *PyErr_Occurred()
    void PyErr_Clear()
    dict _PyDict_NewPresized(Py_ssize_t)
    PyObject *PyDict_GetItemWithError(object, object) except? NULL


cdef extern from *:
    """
    /* Answers go into a dict by the rank's hash, computed once when the rank is named
       (a RankId tuple does not cache its hash). */
    #if PY_VERSION_HEX < 0x030D0000
    #define KV_SET_KNOWN(d, k, v, h) _PyDict_SetItem_KnownHash((d), (k), (v), (h))
    #else
    #define KV_SET_KNOWN(d, k, v, h) PyDict_SetItem((d), (k), (v))
    #endif
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
    """
    int KV_SET_KNOWN(object d, object k, object v, Py_hash_t h) except -1
    unsigned long long KV_AS_U64(PyObject *o)
    void KV_PREFETCH(const void *p) nogil
    int KV_CTZ(uint64_t x) nogil


cdef enum:
    FIELDS = 7  # PrefixMatch's fields


cdef extern from *:
    """
    /* A key table's slot of a mixed key: multiply-high maps it onto any capacity, so a
       table grows by GROW_NUM / GROW_DEN, not by doubling. */
    #define KV_HOME(mixed, cap) ((Py_ssize_t)(((unsigned __int128)(mixed) * (uint64_t)(cap)) >> 64))
    #define KV_SIDE 0x80000000u
    #define KV_VALUE 0x7FFFFFFFu
    """
    Py_ssize_t KV_HOME(uint64_t mixed, Py_ssize_t cap) nogil
    # an entry's val bit: its key is the hash's place in the side list, not the hash
    const uint32_t KV_SIDE
    const uint32_t KV_VALUE  # the rest of val


ctypedef packed struct Entry:
    uint64_t key  # the hash itself, or (KV_SIDE) its place in the side list
    uint32_t val  # a rank set's id or a refcount, and KV_SIDE; 0: a free slot


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


ctypedef struct Answer:
    int64_t f[FIELDS]  # a PrefixMatch's fields; the last -1 for None
    PyObject *obj  # NULL: a free slot


ctypedef struct Probe:
    uint64_t key  # as locate() gives it
    PyObject *obj
    uint64_t mixed  # mix(key)


cdef enum:
    LOOKAHEAD = 16  # positions prefetched ahead of a walk
    BATCH_AHEAD = 16  # hashes of a batch prefetched ahead of their update (a power of 2)
    ANSWERS_KEPT = 4096  # answer objects kept between queries
    NO_ID = 0xFFFFFFFF  # a set id not read yet
    # how a slot's answer is taken to vLLM's hybrid rule
    FULL_ONLY = 0  # it is not: no window group
    IN_C = 1  # one full-attention and one window group: on the window masks, here
    WALKED = 2  # any other hybrid rank: walked on its own tables, when it matched something
    LONELY = 3  # no full-attention group: walked on its own tables always


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


cdef class RankSets:
    """Interned bitsets of rank slots, by id (0: the empty set)."""

    cdef uint64_t *words  # set id -> its ``width`` words
    cdef uint64_t *sig  # set id -> hash of its words (zero words do not count)
    cdef uint32_t *refs  # set id -> entries naming it (+1 for a pinned singleton)
    cdef uint32_t *index  # open addressing over sig: set ids
    cdef uint32_t *spare  # freed ids
    cdef uint32_t *single  # slot -> its singleton's id (0: none yet)
    cdef uint64_t *scratch
    cdef Py_ssize_t width, cap, fresh, nspare, icap, live, nsingle

    def __cinit__(self):
        self.width, self.cap, self.fresh, self.icap, self.nsingle = 1, 64, 1, 128, 64
        self.words = <uint64_t *>PyMem_Malloc(self.cap * self.width * 8)
        self.sig = <uint64_t *>PyMem_Malloc(self.cap * 8)
        self.refs = <uint32_t *>PyMem_Malloc(self.cap * 4)
        self.spare = <uint32_t *>PyMem_Malloc(self.cap * 4)
        self.index = <uint32_t *>PyMem_Malloc(self.icap * 4)
        self.single = <uint32_t *>PyMem_Malloc(self.nsingle * 4)
        self.scratch = <uint64_t *>PyMem_Malloc(self.width * 8)
        if not (self.words and self.sig and self.refs and self.spare and self.index
                and self.single and self.scratch):
            raise MemoryError()
        memset(self.index, 0, self.icap * 4)
        memset(self.single, 0, self.nsingle * 4)
        memset(self.words, 0, self.width * 8)  # set 0: empty

    def __dealloc__(self):
        PyMem_Free(self.words)
        PyMem_Free(self.sig)
        PyMem_Free(self.refs)
        PyMem_Free(self.spare)
        PyMem_Free(self.index)
        PyMem_Free(self.single)
        PyMem_Free(self.scratch)

    cdef int widen(self, Py_ssize_t slots) except -1:
        """Room for ``slots`` slots in every set (sig ignores zero words: unchanged)."""
        cdef Py_ssize_t width = (slots + 63) // 64, i
        if width <= self.width:
            return 0
        cdef uint64_t *words = <uint64_t *>PyMem_Malloc(self.cap * width * 8)
        cdef uint64_t *scratch = <uint64_t *>PyMem_Realloc(self.scratch, width * 8)
        if not words or not scratch:
            raise MemoryError()
        self.scratch = scratch
        memset(words, 0, self.cap * width * 8)
        for i in range(self.fresh):
            memcpy(words + i * width, self.words + i * self.width, self.width * 8)
        PyMem_Free(self.words)
        self.words, self.width = words, width
        return 0

    cdef inline uint64_t sig_of(self, const uint64_t *w) noexcept nogil:
        cdef uint64_t h = 0x9E3779B97F4A7C15ULL
        cdef Py_ssize_t k
        for k in range(self.width):
            if w[k]:
                h ^= mix(w[k] + <uint64_t>k * 0x9E3779B97F4A7C15ULL)
        return h

    cdef uint32_t intern(self, const uint64_t *w) except 0:
        """The id of the set with words ``w``, made if new (refs 0: the caller takes one)."""
        cdef uint64_t h = self.sig_of(w)
        cdef Py_ssize_t m = self.icap - 1, i = mix(h) & m
        cdef uint32_t id
        while self.index[i]:
            id = self.index[i]
            if self.sig[id] == h and memcmp(self.words + id * self.width, w, self.width * 8) == 0:
                return id
            i = (i + 1) & m
        id = self.new_id()
        memcpy(self.words + id * self.width, w, self.width * 8)
        self.sig[id], self.refs[id] = h, 0
        self.index[i] = id
        self.live += 1
        if self.live * 2 > self.icap:
            self.reindex(self.icap * 2)
        return id

    cdef uint32_t new_id(self) except 0:
        if self.nspare:
            self.nspare -= 1
            return self.spare[self.nspare]
        if self.fresh == self.cap:
            self.grow()
        self.fresh += 1
        return <uint32_t>(self.fresh - 1)

    cdef int grow(self) except -1:
        cdef Py_ssize_t cap = self.cap * 2
        cdef void *words = PyMem_Realloc(self.words, cap * self.width * 8)
        if not words:
            raise MemoryError()
        self.words = <uint64_t *>words
        cdef void *sig = PyMem_Realloc(self.sig, cap * 8)
        cdef void *refs = PyMem_Realloc(self.refs, cap * 4) if sig else NULL
        cdef void *spare = PyMem_Realloc(self.spare, cap * 4) if refs else NULL
        if sig:
            self.sig = <uint64_t *>sig
        if refs:
            self.refs = <uint32_t *>refs
        if spare:
            self.spare = <uint32_t *>spare
        if not spare:
            raise MemoryError()
        self.cap = cap
        return 0

    cdef int reindex(self, Py_ssize_t icap) except -1:
        cdef uint32_t *index = <uint32_t *>PyMem_Malloc(icap * 4)
        if not index:
            raise MemoryError()
        memset(index, 0, icap * 4)
        cdef Py_ssize_t i, j, m = icap - 1
        cdef uint32_t id
        for i in range(self.icap):
            id = self.index[i]
            if id:
                j = mix(self.sig[id]) & m
                while index[j]:
                    j = (j + 1) & m
                index[j] = id
        PyMem_Free(self.index)
        self.index, self.icap = index, icap
        return 0

    cdef inline void take(self, uint32_t id) noexcept nogil:
        self.refs[id] += 1

    cdef void drop(self, uint32_t id) noexcept:
        """One reference fewer; a set no entry names leaves the index and its id is reused."""
        self.refs[id] -= 1
        if self.refs[id]:
            return
        cdef Py_ssize_t m = self.icap - 1, i = mix(self.sig[id]) & m, j, home
        while self.index[i] != id:
            i = (i + 1) & m
        j = i
        while True:  # backward-shift deletion: no tombstones
            j = (j + 1) & m
            if not self.index[j]:
                break
            home = mix(self.sig[self.index[j]]) & m
            if (j > i and (home <= i or home > j)) or (j < i and home <= i and home > j):
                self.index[i] = self.index[j]
                i = j
        self.index[i] = 0
        self.live -= 1
        self.spare[self.nspare] = id
        self.nspare += 1

    cdef uint32_t singleton(self, Py_ssize_t slot) except 0:
        """The set of one slot: interned once and pinned (slots are few and reused)."""
        cdef Py_ssize_t n
        if slot >= self.nsingle:
            n = max(slot + 1, 2 * self.nsingle)
            self.single = <uint32_t *>PyMem_Realloc(self.single, n * 4)
            if not self.single:
                raise MemoryError()
            memset(self.single + self.nsingle, 0, (n - self.nsingle) * 4)
            self.nsingle = n
        cdef uint32_t id = self.single[slot]
        if not id:
            memset(self.scratch, 0, self.width * 8)
            self.scratch[slot >> 6] = 1ULL << (slot & 63)
            id = self.single[slot] = self.intern(self.scratch)
            self.refs[id] += 1
        return id

    cdef uint32_t changed(self, uint32_t id, Py_ssize_t slot, bint on) except? 0:
        """The set ``id`` with ``slot`` put in (``on``) or taken out; 0 if that empties it."""
        memcpy(self.scratch, self.words + id * self.width, self.width * 8)
        cdef uint64_t bit = 1ULL << (slot & 63)
        if on:
            self.scratch[slot >> 6] |= bit
        else:
            self.scratch[slot >> 6] &= ~bit
        cdef Py_ssize_t k
        for k in range(self.width):
            if self.scratch[k]:
                return self.intern(self.scratch)
        return 0

    cdef inline bint has(self, uint32_t id, Py_ssize_t slot) noexcept nogil:
        return (self.words[id * self.width + (slot >> 6)] >> (slot & 63)) & 1

    cdef object as_int(self, uint32_t id):
        if self.width == 1:
            return self.words[id]
        cdef bytes raw = (<char *>(self.words + id * self.width))[: self.width * 8]
        return int.from_bytes(raw, "little")


cdef class KeyTable:
    """Open addressing over the hashes of one tier or medium: ``hash -> value``.

    Reads like the ``dict`` of the reference it replaces (``get``, ``in``, ``len``,
    iteration, ``items``, equality with a dict); what the value is, the subclass says.
    """

    cdef Entry *entries
    cdef Py_ssize_t cap, count
    cdef list side  # a side key's place -> the hash (None: free)
    cdef list side_free
    cdef uint64_t *side_hash  # a side key's place -> the hash's Python hash
    cdef Py_ssize_t side_cap

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

    cdef inline Py_ssize_t found(self, const Probe *p, uint64_t *key, PyObject **obj) except? -2:
        """Where a probed hash is (as find()), its key and object given out."""
        key[0], obj[0] = p.key, p.obj
        return self.find(p.key, p.obj, p.mixed)

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

    cdef inline object key_at(self, Py_ssize_t i):
        if self.entries[i].val & KV_SIDE:
            return self.side[self.entries[i].key]
        return self.entries[i].key

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

    cdef RankSets sets

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


cdef class HolderIndex:
    """Per medium, ``hash -> rank set``; the reference's interface, walked in C.

    ``media`` and ``windows`` (the window groups of hybrid models' ranks) map each
    medium to its :class:`HolderTable`; a rank's bit is ``1 << slot``.
    """

    cdef readonly dict media
    cdef readonly dict windows
    # the tables the hybrid rule reads, out of the dicts once (a rank's rule ran 5 dict
    # lookups, most of its cost on a short chain)
    cdef HolderTable gpu, cpu, storage, win_gpu, win_cpu, win_storage
    cdef RankSets sets
    cdef list free_slots
    cdef Py_ssize_t slots
    # the chain being walked: per position its key, mixed key and state (0: not read,
    # 1: an int key, 2: a side key); per rank slot its runs; answers kept across queries
    cdef uint64_t *wkey
    cdef uint64_t *wmix
    cdef uint8_t *wstate
    cdef uint32_t *ids
    cdef Py_ssize_t wcap
    cdef PyObject **witems
    cdef int32_t *runs  # 3 per slot: GPU run, CPU run, STORAGE run (in chunks)
    cdef uint64_t *active  # 2 x width words: two walks' active slots (first: the candidates)
    cdef Py_ssize_t rcap
    cdef Answer *answers
    cdef Py_ssize_t acap, acount
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

    def __cinit__(self):
        self.sets = RankSets()
        self.media = {m: HolderTable(self.sets) for m in MEDIA}
        self.windows = {m: HolderTable(self.sets) for m in MEDIA}
        self.gpu, self.cpu, self.storage = self.media[GPU], self.media[CPU], self.media[STORAGE]
        self.win_gpu, self.win_cpu = self.windows[GPU], self.windows[CPU]
        self.win_storage = self.windows[STORAGE]
        self.free_slots = []
        self.learned_sizes = {}
        self.snap_id = 1  # the empty snapshot
        self.acap = 2 * ANSWERS_KEPT
        self.answers = <Answer *>PyMem_Malloc(self.acap * sizeof(Answer))
        if not self.answers:
            raise MemoryError()
        memset(self.answers, 0, self.acap * sizeof(Answer))

    def __dealloc__(self):
        cdef Py_ssize_t slot
        for slot in range(self.named_cap):
            Py_XDECREF(self.slot_rank[slot])
            Py_XDECREF(self.slot_engine[slot])
        self.release_snapshot()
        PyMem_Free(self.snap)
        self.forget_answers()
        PyMem_Free(self.answers)
        PyMem_Free(self.wkey)
        PyMem_Free(self.wmix)
        PyMem_Free(self.wstate)
        PyMem_Free(self.ids)
        PyMem_Free(self.runs)
        PyMem_Free(self.active)
        PyMem_Free(self.slot_rank)
        PyMem_Free(self.slot_engine)
        PyMem_Free(self.slot_hash)
        PyMem_Free(self.slot_learned)
        PyMem_Free(self.slot_seen)
        PyMem_Free(self.slot_declared)
        PyMem_Free(self.cslot)
        PyMem_Free(self.csize)
        PyMem_Free(self.cans)
        PyMem_Free(self.asked)
        PyMem_Free(self.wids)
        PyMem_Free(self.hkind)
        PyMem_Free(self.hwin)
        PyMem_Free(self.hbs)
        PyMem_Free(self.memo_mask)

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

    def name(self, bit: int, rank) -> None:
        """Name ``rank`` as the one on ``bit``'s slot: answers are keyed by it."""
        cdef Py_ssize_t slot = bit.bit_length() - 1, n, was = self.named_cap
        if slot >= was:
            n = max(slot + 1, 2 * was)
            self.slot_rank = <PyObject **>PyMem_Realloc(self.slot_rank, n * sizeof(PyObject *))
            self.slot_engine = <PyObject **>PyMem_Realloc(self.slot_engine,
                                                         n * sizeof(PyObject *))
            self.slot_hash = <Py_hash_t *>PyMem_Realloc(self.slot_hash, n * sizeof(Py_hash_t))
            self.slot_learned = <Py_ssize_t *>PyMem_Realloc(self.slot_learned,
                                                           n * sizeof(Py_ssize_t))
            self.slot_seen = <uint64_t *>PyMem_Realloc(self.slot_seen, n * 8)
            self.slot_declared = <Py_ssize_t *>PyMem_Realloc(self.slot_declared,
                                                            n * sizeof(Py_ssize_t))
            if not (self.slot_rank and self.slot_engine and self.slot_hash
                    and self.slot_learned and self.slot_seen and self.slot_declared):
                raise MemoryError()
            memset(self.slot_rank + was, 0, (n - was) * sizeof(PyObject *))
            memset(self.slot_engine + was, 0, (n - was) * sizeof(PyObject *))
            memset(self.slot_learned + was, 0, (n - was) * sizeof(Py_ssize_t))
            self.named_cap = n
        self.unname(slot)
        engine = rank.engine
        self.slot_hash[slot] = PyObject_Hash(rank)
        Py_INCREF(rank)
        Py_INCREF(engine)
        self.slot_rank[slot], self.slot_engine[slot] = <PyObject *>rank, <PyObject *>engine

    def learned(self, bit: int, size) -> None:
        """The chunk size ``bit``'s rank (named) learned from its events (None: none):
        its size wherever a query declares none for its engine."""
        cdef Py_ssize_t slot = bit.bit_length() - 1
        if slot >= self.named_cap or self.slot_rank[slot] == NULL:
            raise KeyError(bit)
        self.forget_learned(slot)
        if size:
            self.slot_learned[slot] = size
            self.learned_sizes[size] = self.learned_sizes.get(size, 0) + 1

    cdef int unname(self, Py_ssize_t slot) except -1:
        self.forget_learned(slot)
        Py_XDECREF(self.slot_rank[slot])
        Py_XDECREF(self.slot_engine[slot])
        self.slot_rank[slot] = self.slot_engine[slot] = NULL
        self.slot_seen[slot] = 0
        return 0

    cdef int forget_learned(self, Py_ssize_t slot) except -1:
        cdef Py_ssize_t size = self.slot_learned[slot]
        if size:
            if self.learned_sizes[size] == 1:
                del self.learned_sizes[size]
            else:
                self.learned_sizes[size] -= 1
            self.slot_learned[slot] = 0
        return 0

    def add(self, medium, bit, hashes, media=None) -> None:
        """Set ``bit`` on every hash (idempotent); ``media``: :attr:`media` or :attr:`windows`."""
        (<HolderTable>(media or self.media)[medium]).put(bit.bit_length() - 1, hashes, True)

    def discard(self, medium, bit, hashes, media=None) -> None:
        """Clear ``bit`` on every hash (idempotent); a hash no rank holds leaves."""
        (<HolderTable>(media or self.media)[medium]).put(bit.bit_length() - 1, hashes, False)

    # ---- the walk -----------------------------------------------------------------------

    cdef int room(self, Py_ssize_t n) except -1:
        """Buffers for a chain of ``n`` and for every slot."""
        if n > self.wcap:
            self.wcap = max(n, 2 * self.wcap)
            self.wkey = <uint64_t *>PyMem_Realloc(self.wkey, self.wcap * 8)
            self.wmix = <uint64_t *>PyMem_Realloc(self.wmix, self.wcap * 8)
            self.wstate = <uint8_t *>PyMem_Realloc(self.wstate, self.wcap)
            self.ids = <uint32_t *>PyMem_Realloc(self.ids, 2 * self.wcap * 4)
            self.wids = <uint32_t *>PyMem_Realloc(self.wids, 3 * self.wcap * 4)
        if self.slots > self.rcap:
            self.rcap = max(self.slots, 2 * self.rcap)
            self.runs = <int32_t *>PyMem_Realloc(self.runs, 3 * self.rcap * 4)
            self.active = <uint64_t *>PyMem_Realloc(self.active, 2 * ((self.rcap + 63) // 64) * 8)
            self.cslot = <int32_t *>PyMem_Realloc(self.cslot, self.rcap * 4)
            self.csize = <Py_ssize_t *>PyMem_Realloc(self.csize, self.rcap * sizeof(Py_ssize_t))
            self.cans = <PyObject **>PyMem_Realloc(self.cans, self.rcap * sizeof(PyObject *))
        if self.sets.width > self.memo_width:
            self.memo_width = self.sets.width
            self.memo_mask = <uint64_t *>PyMem_Realloc(self.memo_mask, 4 * self.memo_width * 8)
        if not (self.wkey and self.wmix and self.wstate and self.ids and self.wids and self.runs
                and self.memo_mask
                and self.active and self.cslot and self.csize and self.cans):
            raise MemoryError()
        memset(self.wstate, 0, n)
        return 0

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

    cdef int walk(
        self, HolderTable t, Py_ssize_t first, Py_ssize_t stride, Py_ssize_t count,
        uint64_t *active, int32_t *out, uint32_t *ids,
    ) except -1:
        """For each slot of ``active``: how many of positions first, first + stride, ...
        (``count`` of them) hold it, from the start (``out[3 * slot]``). Set ids read
        are kept in ``ids`` (others stay NO_ID). ``active`` is consumed."""
        cdef RankSets sets = self.sets
        cdef Py_ssize_t width = sets.width, j, k, p, ahead = min(LOOKAHEAD, count)
        cdef uint32_t id, last = NO_ID
        cdef uint64_t *w
        cdef uint64_t gone, left
        if t.count:
            for j in range(ahead):
                p = first + j * stride
                self.read(p)
                KV_PREFETCH(&t.entries[t.home(self.wmix[p])])
            j = 0
            while j < count:
                if j + ahead < count:
                    p = first + (j + ahead) * stride
                    self.read(p)
                    KV_PREFETCH(&t.entries[t.home(self.wmix[p])])
                id = self.lookup(t, first + j * stride)
                ids[j] = id
                if id != last:
                    last = id
                    w = sets.words + id * width
                    left = 0
                    for k in range(width):
                        gone = active[k] & ~w[k]
                        while gone:
                            out[3 * (k * 64 + KV_CTZ(gone))] = <int32_t>j
                            gone &= gone - 1
                        active[k] &= w[k]
                        left |= active[k]
                    if not left:
                        return 0
                j += 1
        else:
            count = 0
        for k in range(width):
            gone = active[k]
            while gone:
                out[3 * (k * 64 + KV_CTZ(gone))] = <int32_t>count
                gone &= gone - 1
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

    cdef bint covered(
        self, Py_ssize_t memo, Py_ssize_t lo, Py_ssize_t hi, HolderTable a, uint32_t *a_ids,
        HolderTable b, uint32_t *b_ids, Py_ssize_t size, Py_ssize_t slot,
    ) except -1:
        """Whether ``slot`` holds every unit of ``[lo, hi)`` in ``a`` or ``b``. The slots
        that do are computed once for all ranks asking ``memo`` about the same units."""
        cdef Py_ssize_t width = self.sets.width, k, u
        cdef uint64_t *mask = self.memo_mask + memo * width
        cdef uint64_t *words = self.sets.words
        cdef uint32_t ia, ib
        if self.memo_lo[memo] != lo or self.memo_hi[memo] != hi:
            for k in range(width):
                mask[k] = ~0ULL
            for u in range(lo, hi):
                ia = self.id_at(a, a_ids, u, size)
                ib = 0 if b is None else self.id_at(b, b_ids, u, size)
                for k in range(width):
                    mask[k] &= words[ia * width + k] | words[ib * width + k]
            self.memo_lo[memo], self.memo_hi[memo] = lo, hi
        return (mask[slot >> 6] >> (slot & 63)) & 1

    # ---- hybrid models' ranks: vLLM's hybrid rule ----------------------------------------

    cdef int hybrid_slots(self, object hybrids) except -1:
        """Each slot's hybrid kind (IN_C, WALKED, LONELY), window and block size, read
        again from ``hybrids`` only when its ranks changed (its ``generation``)."""
        generation = hybrids.generation
        if hybrids is self.hybrids_seen and generation == self.generation_seen:
            return 0
        cdef Py_ssize_t n = max(self.slots, 1), slot
        if n > self.hcap:
            self.hkind = <uint8_t *>PyMem_Realloc(self.hkind, n)
            self.hwin = <int64_t *>PyMem_Realloc(self.hwin, n * 8)
            self.hbs = <int64_t *>PyMem_Realloc(self.hbs, n * 8)
            if not (self.hkind and self.hwin and self.hbs):
                raise MemoryError()
            self.hcap = n
        memset(self.hkind, FULL_ONLY, self.hcap)
        simple = 0
        for rule, bits in hybrids.simple.items():
            simple |= bits
            while bits:
                low = bits & -bits
                bits ^= low
                slot = low.bit_length() - 1
                self.hkind[slot] = IN_C
                self.hwin[slot], self.hbs[slot] = rule.window, rule.block_size
        rest = hybrids.bits & ~simple
        while rest:
            low = rest & -rest
            rest ^= low
            self.hkind[low.bit_length() - 1] = LONELY if hybrids.unanchored & low else WALKED
        self.hybrids_seen, self.generation_seen = hybrids, generation
        return 0

    cdef Py_ssize_t window_hit(
        self, Py_ssize_t memo, Py_ssize_t need, Py_ssize_t start, Py_ssize_t cap, HolderTable a,
        uint32_t *a_ids, HolderTable b, uint32_t *b_ids, Py_ssize_t size, Py_ssize_t slot,
    ) except -1:
        """A window group's hit over units ``[start, cap)`` (blocks: ``size`` 1; else
        chunks), held in ``a`` or ``b`` (None: ``a`` alone): scanning right to left from
        the cap, the end of the rightmost run of ``need`` held units, else the run held
        from ``start``; the cap lowered to it until it stays. When the units just below the cap are all
        held (``memo``: see :meth:`covered`), the cap is the hit."""
        cdef Py_ssize_t hit = cap, low, unit, run
        if cap > start and self.covered(memo, max(start, cap - need), cap, a, a_ids, b, b_ids,
                                        size, slot):
            return cap
        while hit > start:
            low, run, unit = -1, 0, hit - 1
            while unit >= start:
                if self.holds(a, a_ids, unit, size, slot) or (
                    b is not None and self.holds(b, b_ids, unit, size, slot)
                ):
                    run += 1
                    if run == need:
                        low = unit + need
                        break
                else:
                    run = 0
                unit -= 1
            if low < 0:
                low = start + run
            if low == hit:
                break
            hit = low
        return max(hit, start)

    cdef int hybrid_rule(
        self, int64_t *f, Py_ssize_t slot, Py_ssize_t size, Py_ssize_t chunks,
        uint32_t *cpu_ids, uint32_t *storage_ids,
    ) except -1:
        """``f``, the full-attention answer of a rank with one window group, taken to
        vLLM's hybrid rule on the window masks. GPU: the window group's hit below the
        full-attention run (which that hit cannot lower: the one pass is the fixed
        point). Lower tiers, in chunks: each tier's hit below its full-attention run;
        the prefix from the chunk holding the GPU hit's end, as far as the
        full-attention group holds the chunks on CPU or STORAGE (past the GPU run: its
        prefix), lowered by the window group's hit over both; a prefix chunk is taken
        from CPU when the full-attention group holds it there."""
        cdef int64_t window = self.hwin[slot], bs = self.hbs[slot], full = f[0], past = f[3]
        cdef Py_ssize_t need = 1 if window == 0 else max(1, (window - 1 + bs - 1) // bs)
        cdef HolderTable cpu = self.cpu, storage = self.storage
        cdef Py_ssize_t gpu = self.window_hit(0, need, 0, full, self.win_gpu, self.wids,
                                              None, NULL, 1, slot)
        f[6] = full if full != gpu else -1
        f[0] = f[3] = gpu
        if not chunks:
            return 0
        cdef HolderTable w_cpu = self.win_cpu, w_storage = self.win_storage
        cdef uint32_t *w_cpu_ids = self.wids + self.wcap
        cdef uint32_t *w_storage_ids = self.wids + 2 * self.wcap
        need = 1 if window == 0 else (window + size * bs - 1) // (size * bs)
        f[1] = size * self.window_hit(1, need, 0, f[1] // size, w_cpu, w_cpu_ids, None, NULL,
                                      size, slot)
        f[2] = size * self.window_hit(2, need, 0, f[2] // size, w_storage, w_storage_ids, None,
                                      NULL, size, slot)
        cdef Py_ssize_t first = gpu // size, stop = full // size, reach = first, j
        while reach < stop and (self.holds(cpu, cpu_ids, reach, size, slot)
                                or self.holds(storage, storage_ids, reach, size, slot)):
            reach += 1
        if reach == stop:
            reach = past // size
        cdef Py_ssize_t end = self.window_hit(3, need, first, reach, w_cpu, w_cpu_ids, w_storage,
                                              w_storage_ids, size, slot)
        f[3] = max(gpu, end * size)
        f[4] = 0
        if end > first:
            for j in range(first, end):
                if self.holds(cpu, cpu_ids, j, size, slot):
                    f[4] += size
            if self.holds(cpu, cpu_ids, first, size, slot):  # partly on GPU
                f[4] -= gpu - first * size
        f[5] = f[3] - gpu - f[4]
        return 0

    cdef void forget_answers(self) noexcept:
        cdef Py_ssize_t i
        for i in range(self.acap):
            if self.answers[i].obj != NULL:
                Py_DECREF(<object>self.answers[i].obj)
                self.answers[i].obj = NULL
        self.acount = 0

    cdef PyObject *answer(self, int64_t *f) except NULL:
        """The one shared (immutable) PrefixMatch with fields ``f``: most ranks repeat a few."""
        cdef uint64_t h = 0
        cdef Py_ssize_t i, k
        if not (f[0] | f[1] | f[2] | f[3]) and f[6] < 0:
            return <PyObject *>EMPTY
        for k in range(FIELDS):
            h = mix(h ^ <uint64_t>f[k])
        i = h & (self.acap - 1)
        while self.answers[i].obj != NULL:
            if memcmp(self.answers[i].f, f, FIELDS * 8) == 0:
                return self.answers[i].obj
            i = (i + 1) & (self.acap - 1)
        if (self.acount + 1) * 2 > self.acap:
            self.regrow_answers()
            return self.answer(f)
        match = PrefixMatch(f[0], f[1], f[2], f[3], f[4], f[5], None if f[6] < 0 else f[6])
        Py_INCREF(match)
        memcpy(self.answers[i].f, f, FIELDS * 8)
        self.answers[i].obj = <PyObject *>match
        self.acount += 1
        return <PyObject *>match

    cdef int regrow_answers(self) except -1:
        cdef Answer *old = self.answers
        cdef Py_ssize_t n = self.acap, i, j, k
        cdef uint64_t h
        self.answers = <Answer *>PyMem_Malloc(2 * n * sizeof(Answer))
        if not self.answers:
            self.answers = old
            raise MemoryError()
        memset(self.answers, 0, 2 * n * sizeof(Answer))
        self.acap = 2 * n
        for i in range(n):
            if old[i].obj != NULL:
                h = 0
                for k in range(FIELDS):
                    h = mix(h ^ <uint64_t>old[i].f[k])
                j = h & (self.acap - 1)
                while self.answers[j].obj != NULL:
                    j = (j + 1) & (self.acap - 1)
                self.answers[j] = old[i]
        PyMem_Free(old)
        return 0

    cdef Py_ssize_t sizes_asked(self, dict chunk_blocks) except -1:
        """The distinct chunk sizes ``chunk_blocks`` gives its engines (0: GPU only), those
        learned too where it gives none: every size a listed rank can be matched with."""
        cdef Py_ssize_t pos = 0, count = 0, size, i = 0
        cdef PyObject *key
        cdef PyObject *value
        cdef PyObject *seen = NULL
        cdef PyObject **snap = self.snap
        cdef bint learned = False, same = len(chunk_blocks) == self.snap_n
        while PyDict_Next(chunk_blocks, &pos, &key, &value):
            if same and (snap[2 * i] != key or snap[2 * i + 1] != value):
                same = False
            i += 1
            if value != seen:  # most engines share one size object
                seen = value
                size = <object>value or 0
                if size:
                    count = self.ask(count, size)
                else:
                    learned = True
        if not same:
            self.snapshot(chunk_blocks)
        if learned:
            count = self.ask(count, 0)
            for size in self.learned_sizes:
                count = self.ask(count, size)
        return count

    cdef int snapshot(self, dict chunk_blocks) except -1:
        """Hold ``chunk_blocks``' entries as the snapshot that slots' sizes are kept for."""
        cdef Py_ssize_t pos = 0, n = len(chunk_blocks), i = 0
        cdef PyObject *key
        cdef PyObject *value
        self.release_snapshot()
        if 2 * n > self.snap_cap:
            self.snap_cap = max(2 * n, 2 * self.snap_cap)
            self.snap = <PyObject **>PyMem_Realloc(self.snap, self.snap_cap * sizeof(PyObject *))
            if not self.snap:
                raise MemoryError()
        while PyDict_Next(chunk_blocks, &pos, &key, &value):
            Py_INCREF(<object>key)
            Py_INCREF(<object>value)
            self.snap[2 * i], self.snap[2 * i + 1] = key, value
            i += 1
        self.snap_n = n
        self.snap_id += 1
        return 0

    cdef void release_snapshot(self) noexcept:
        cdef Py_ssize_t i
        for i in range(2 * self.snap_n):
            Py_DECREF(<object>self.snap[i])
        self.snap_n = 0

    cdef Py_ssize_t ask(self, Py_ssize_t count, Py_ssize_t size) except -1:
        cdef Py_ssize_t i
        for i in range(count):
            if self.asked[i] == size:
                return count
        if count == self.asked_cap:
            self.asked_cap = max(8, 2 * self.asked_cap)
            self.asked = <Py_ssize_t *>PyMem_Realloc(self.asked, self.asked_cap * sizeof(Py_ssize_t))
            if not self.asked:
                raise MemoryError()
        self.asked[count] = size
        return count + 1

    cdef int hold_any(self, HolderTable t, Py_ssize_t i, uint64_t *mask) except -1:
        """Add to ``mask`` the slots holding position ``i`` in ``t`` (read() it first)."""
        cdef Py_ssize_t width = self.sets.width, k
        cdef uint64_t *w = self.sets.words + self.lookup(t, i) * width
        for k in range(width):
            mask[k] |= w[k]
        return 0

    cdef Py_ssize_t candidates(
        self, dict chunk_blocks, Py_ssize_t n, Py_ssize_t nsizes, uint8_t *hkind,
    ) except -1:
        """The listed slots that may match something, with their chunk sizes (``cslot``,
        ``csize``; their count returned; their mask left in ``active``).

        A rank holding neither the chain's first block on GPU nor, for its chunk size,
        the first chunk's end on CPU or STORAGE matches nothing: only the slots holding
        one of these few positions (for every size asked), and hybrid ranks walked on
        their own tables, are looked up in ``chunk_blocks``.
        """
        cdef Py_ssize_t width = self.sets.width, k, i, slot, size, count = 0
        cdef uint64_t *cand = self.active
        cdef uint64_t word
        cdef PyObject *found
        cdef PyObject *seen = NULL
        cdef Py_ssize_t seen_size = 0
        memset(cand, 0, width * 8)
        self.read(0)
        self.hold_any(self.gpu, 0, cand)
        for i in range(nsizes):
            size = self.asked[i]
            if 0 < size <= n:
                self.read(size - 1)
                self.hold_any(self.cpu, size - 1, cand)
                self.hold_any(self.storage, size - 1, cand)
        if hkind != NULL:
            for slot in range(min(self.hcap, width * 64)):
                if hkind[slot] == LONELY:
                    cand[slot >> 6] |= 1ULL << (slot & 63)
        for k in range(width):
            word = cand[k]
            while word:
                slot = k * 64 + KV_CTZ(word)
                word &= word - 1
                if slot >= self.named_cap or self.slot_rank[slot] == NULL:
                    cand[k] &= ~(1ULL << (slot & 63))
                    continue
                if self.slot_seen[slot] != self.snap_id:
                    found = PyDict_GetItemWithError(chunk_blocks,
                                                    <object>self.slot_engine[slot])
                    if found != seen and found != NULL:
                        seen, seen_size = found, <object>found or 0
                    self.slot_declared[slot] = -1 if found == NULL else seen_size
                    self.slot_seen[slot] = self.snap_id
                size = self.slot_declared[slot]
                if size < 0:  # not listed
                    cand[k] &= ~(1ULL << (slot & 63))
                    continue
                size = size or self.slot_learned[slot]
                self.cslot[count], self.csize[count] = <int32_t>slot, size
                self.cans[count] = NULL
                count += 1
        return count

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
        if self.acount > ANSWERS_KEPT:
            self.forget_answers()
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
                    last_answer = self.answer(f)
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
