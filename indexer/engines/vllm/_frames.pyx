# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""vLLM 0.33 batch payloads scanned in C for the index: the fields it reads, no others.

msgspec builds a struct per event and a Python object per field it keeps. A
vLLM GPU pool evicts one block per ``BlockRemoved``, so a batch holds hundreds
of one-hash events, and building them was most of ingest. This scanner reads a
payload once, skips token ids and every other field the index does not read
(checking only that they are well-formed msgpack), and builds one event per
stretch of consecutive events alike in every field but their hashes (GPU
stores and removals), their hashes concatenated: the index counts them the same.

It takes only what it is sure msgspec takes, and answers None for anything else
(legacy positional events, encodings vLLM never writes, any malformation): the
msgspec path then decodes it, as the executable spec, and raises its errors. So
it accepts and rejects exactly what that path does
(``tests/test_frames.py`` checks it against it).
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.list cimport PyList_Append
from cpython.long cimport PyLong_FromLongLong, PyLong_FromUnsignedLongLong
from cpython.mem cimport PyMem_Free, PyMem_Realloc
from libc.stdint cimport int64_t, uint8_t, uint64_t
from libc.string cimport memcmp, memcpy, strlen


cdef extern from "Python.h":
    object PyUnicode_DecodeUTF8(const char *s, Py_ssize_t size, const char *errors)
    void PyErr_Clear()


cdef enum:
    NO = -1  # not taken here: the msgspec path decodes it
    MAX_DEPTH = 32  # nesting skipped here; deeper payloads go to msgspec

cdef enum:
    ABSENT = 0  # missing or nil: None
    INT = 1
    STR = 2

cdef enum:
    STORED = 0
    REMOVED = 1
    CLEARED = 2

# The fields read, by their place in the events' positional construction: the order
# of StoredHashes' fields (BlockRemoved's: those a removal has, in this order too).
cdef enum:
    F_HASHES = 0
    F_SIZE = 1
    F_MEDIUM = 2
    F_GROUP = 3
    F_KIND = 4
    F_WINDOW = 5
    F_LOCALITY = 6
    F_OWNERSHIP = 7
    F_UNKNOWN = 8
    F_TYPE = 9


cdef struct Val:
    int kind
    int64_t i
    const uint8_t *s
    Py_ssize_t n


cdef struct Cur:
    const uint8_t *p
    const uint8_t *end


cdef struct Ev:
    int cls
    Val f[8]  # by field number; F_HASHES and F_SIZE unused here
    int64_t size
    const uint8_t *hashes  # the first element of block_hashes
    Py_ssize_t nhashes


cdef inline uint64_t be(const uint8_t *p, int n) noexcept nogil:
    cdef uint64_t v = 0
    cdef int k
    for k in range(n):
        v = (v << 8) | p[k]
    return v


cdef inline double float_be(const uint8_t *p) noexcept nogil:
    cdef uint64_t bits = be(p, 8)
    cdef double out
    memcpy(&out, &bits, 8)
    return out


cdef inline bint room(Cur *c, Py_ssize_t n) noexcept nogil:
    return c.end - c.p >= n


cdef inline Py_ssize_t length(Cur *c, uint8_t fix_lo, uint8_t fix_hi, uint8_t w16, uint8_t w32) noexcept nogil:
    """An array's or map's length (by its type bytes), NO if the next value is not one."""
    if not room(c, 1):
        return NO
    cdef uint8_t b = c.p[0]
    cdef Py_ssize_t n
    if fix_lo <= b <= fix_hi:
        c.p += 1
        return b & 0x0F
    if b == w16 and room(c, 3):
        n = <Py_ssize_t>be(c.p + 1, 2)
        c.p += 3
        return n
    if b == w32 and room(c, 5):
        n = <Py_ssize_t>be(c.p + 1, 4)
        c.p += 5
        return n
    return NO


cdef inline Py_ssize_t array_len(Cur *c) noexcept nogil:
    return length(c, 0x90, 0x9F, 0xDC, 0xDD)


cdef inline Py_ssize_t map_len(Cur *c) noexcept nogil:
    return length(c, 0x80, 0x8F, 0xDE, 0xDF)


cdef inline int sized(Cur *c, Py_ssize_t n, const uint8_t **s, Py_ssize_t *size) noexcept nogil:
    """Take ``n`` bytes of payload (a str's or bin's), NO past the end."""
    if not room(c, n):
        return NO
    s[0] = c.p
    size[0] = n
    c.p += n
    return 0


cdef inline int read_str(Cur *c, const uint8_t **s, Py_ssize_t *n) noexcept nogil:
    """A str's bytes (their UTF-8 is checked where they become a str), NO if no str."""
    if not room(c, 1):
        return NO
    cdef uint8_t b = c.p[0]
    if 0xA0 <= b <= 0xBF:
        c.p += 1
        return sized(c, b & 0x1F, s, n)
    if b == 0xD9 and room(c, 2):
        c.p += 2
        return sized(c, (c.p - 1)[0], s, n)
    if b == 0xDA and room(c, 3):
        c.p += 3
        return sized(c, <Py_ssize_t>be(c.p - 2, 2), s, n)
    if b == 0xDB and room(c, 5):
        c.p += 5
        return sized(c, <Py_ssize_t>be(c.p - 4, 4), s, n)
    return NO


cdef inline int read_int(Cur *c, int64_t *out) noexcept nogil:
    """An int that fits 64 signed bits, NO for anything else (bools are no ints)."""
    if not room(c, 1):
        return NO
    cdef uint8_t b = c.p[0]
    cdef int width
    cdef uint64_t v
    if b <= 0x7F or b >= 0xE0:
        out[0] = <int64_t>(<signed char>b)
        c.p += 1
        return 0
    if 0xCC <= b <= 0xCF:  # uint 8/16/32/64
        width = 1 << (b - 0xCC)
        if not room(c, 1 + width):
            return NO
        v = be(c.p + 1, width)
        if v > <uint64_t>0x7FFFFFFFFFFFFFFF:
            return NO
        out[0] = <int64_t>v
    elif 0xD0 <= b <= 0xD3:  # int 8/16/32/64, two's complement
        width = 1 << (b - 0xD0)
        if not room(c, 1 + width):
            return NO
        v = be(c.p + 1, width)
        if width < 8 and v >> (8 * width - 1):
            v |= ~((<uint64_t>1 << (8 * width)) - 1)
        out[0] = <int64_t>v
    else:
        return NO
    c.p += 1 + width
    return 0


cdef inline int read_optional(Cur *c, Val *v, bint text) noexcept nogil:
    """A ``str | None`` (``text``) or ``int | None`` field."""
    if room(c, 1) and c.p[0] == 0xC0:
        c.p += 1
        v.kind = ABSENT
        return 0
    if text:
        v.kind = STR
        return read_str(c, &v.s, &v.n)
    v.kind = INT
    return read_int(c, &v.i)


cdef inline int skip_uint(Cur *c) noexcept nogil:
    """Step over an unsigned int inline (token ids: most of a payload), NO for another value."""
    if not room(c, 1):
        return NO
    cdef uint8_t b = c.p[0]
    cdef Py_ssize_t n
    if b <= 0x7F:
        c.p += 1
        return 0
    if 0xCC <= b <= 0xCF:
        n = 1 + (1 << (b - 0xCC))
        if room(c, n):
            c.p += n
            return 0
    return NO


cdef inline int hash_item(Cur *c) noexcept nogil:
    """Step over one block hash: an int >= 0 (as msgspec's encoder writes it) or bytes."""
    if skip_uint(c) == 0:
        return 0
    if not room(c, 1) or not 0xC4 <= c.p[0] <= 0xC6:
        return NO
    cdef Py_ssize_t n = 1 + (1 << (c.p[0] - 0xC4))
    if not room(c, n):
        return NO
    n += <Py_ssize_t>be(c.p + 1, <int>(n - 1))
    if not room(c, n):
        return NO
    c.p += n
    return 0


cdef object hash_value(Cur *c):
    """The Python value of a hash :func:`hash_item` accepted."""
    cdef uint8_t b = c.p[0]
    cdef int width
    cdef Py_ssize_t n
    if b <= 0x7F:
        c.p += 1
        return PyLong_FromLongLong(b)
    if b >= 0xCC:
        width = 1 << (b - 0xCC)
        c.p += 1 + width
        return PyLong_FromUnsignedLongLong(be(c.p - width, width))
    width = 1 << (b - 0xC4)
    n = <Py_ssize_t>be(c.p + 1, width)
    c.p += 1 + width + n
    return PyBytes_FromStringAndSize(<const char *>(c.p - n), n)


cdef int valid_utf8(const uint8_t *s, Py_ssize_t n) except -2:
    """0 if the bytes are UTF-8 Python decodes, else NO."""
    try:
        PyUnicode_DecodeUTF8(<const char *>s, n, NULL)
    except UnicodeDecodeError:
        return NO
    return 0


cdef int skip(Cur *c, int depth) except -2:
    """Step over one well-formed value of a field the index does not read."""
    if not room(c, 1) or depth > MAX_DEPTH:
        return NO
    cdef uint8_t b = c.p[0]
    cdef Py_ssize_t n, k
    cdef const uint8_t *s
    if b <= 0x7F or b >= 0xE0 or b == 0xC0 or b == 0xC2 or b == 0xC3:
        c.p += 1
        return 0
    if 0xCC <= b <= 0xD3:
        n = 1 << ((b - 0xCC) & 3)
    elif b == 0xCA or b == 0xCB:
        n = 4 if b == 0xCA else 8
    elif 0xC4 <= b <= 0xC6:
        return 0 if hash_item(c) == 0 else NO
    elif 0xA0 <= b <= 0xBF or 0xD9 <= b <= 0xDB:
        if read_str(c, &s, &n) == NO:
            return NO
        return valid_utf8(s, n)
    elif 0x80 <= b <= 0x8F or b == 0xDE or b == 0xDF:
        n = map_len(c)
        for k in range(2 * n):
            if skip(c, depth + 1) == NO:
                return NO
        return 0
    elif 0x90 <= b <= 0x9F or b == 0xDC or b == 0xDD:
        n = array_len(c)
        for k in range(n):
            if skip_uint(c) == NO and skip(c, depth + 1) == NO:
                return NO
        return 0
    else:  # ext types and 0xC1: left to msgspec
        return NO
    if not room(c, 1 + n):
        return NO
    c.p += 1 + n
    return 0


cdef inline bint named(const uint8_t *s, Py_ssize_t n, const char *name, Py_ssize_t size) noexcept nogil:
    return n == size and memcmp(s, name, size) == 0


cdef const char *NAMES[F_UNKNOWN]
NAMES[:] = [
    b"block_hashes", b"block_size", b"medium", b"group_idx", b"kv_cache_spec_kind",
    b"kv_cache_spec_sliding_window", b"locality", b"ownership",
]
cdef Py_ssize_t LENGTHS[F_UNKNOWN]
for _k in range(F_UNKNOWN):
    LENGTHS[_k] = strlen(NAMES[_k])
#: The fields each class reads, as bits by field number (a BlockRemoved has no
#: block_size nor kinds: keys of those names are unknown fields to it).
cdef int READS[3]
READS[:] = [0xFF, 1 << F_HASHES | 1 << F_MEDIUM | 1 << F_GROUP | 1 << F_LOCALITY | 1 << F_OWNERSHIP, 0]


cdef int field_of(const uint8_t *s, Py_ssize_t n, int cls) noexcept nogil:
    """The field a key names in an event of ``cls`` (F_UNKNOWN: skipped unread)."""
    cdef int k
    if named(s, n, b"type", 4):
        return F_TYPE
    for k in range(F_UNKNOWN):
        if n == LENGTHS[k] and READS[cls] >> k & 1 and memcmp(s, NAMES[k], n) == 0:
            return k
    return F_UNKNOWN


cdef int event_class(Cur *c) noexcept nogil:
    """The class named by the event's leading ``"type"`` (msgspec writes the tag first)."""
    cdef const uint8_t *s
    cdef Py_ssize_t n
    if read_str(c, &s, &n) == NO or not named(s, n, b"type", 4):
        return NO
    if read_str(c, &s, &n) == NO:
        return NO
    if named(s, n, b"BlockStored", 11):
        return STORED
    if named(s, n, b"BlockRemoved", 12):
        return REMOVED
    if named(s, n, b"AllBlocksCleared", 16):
        return CLEARED
    return NO


cdef int read_hashes(Cur *c, Ev *e, Py_ssize_t most) noexcept nogil:
    cdef Py_ssize_t n = array_len(c), k
    if n == NO or n > most:
        return NO
    e.hashes, e.nhashes = c.p, n
    for k in range(n):
        if hash_item(c) == NO:
            return NO
    return 0


cdef int read_field(Cur *c, Ev *e, int field) noexcept nogil:
    if field == F_SIZE:
        return read_int(c, &e.size)
    return read_optional(c, &e.f[field], field in (F_MEDIUM, F_KIND, F_LOCALITY, F_OWNERSHIP))


cdef int read_event(Cur *c, Ev *e, Py_ssize_t most) except -2:
    """One event map into ``e``; NO for anything msgspec might read otherwise."""
    cdef Py_ssize_t n = map_len(c), k
    cdef int field, seen = 0
    cdef const uint8_t *s
    cdef Py_ssize_t size
    if n < 1:
        return NO
    e.cls = event_class(c)
    if e.cls == NO:
        return NO
    for k in range(8):
        e.f[k].kind = ABSENT
    e.size, e.nhashes = 0, NO
    for k in range(n - 1):
        if read_str(c, &s, &size) == NO:
            return NO
        field = field_of(s, size, e.cls)
        if field == F_UNKNOWN:
            if skip(c, 0) == NO:
                return NO
            continue
        if field == F_TYPE or seen & (1 << field):  # a repeated key: left to msgspec
            return NO
        seen |= 1 << field
        if field == F_HASHES:
            if read_hashes(c, e, most) == NO:
                return NO
        elif read_field(c, e, field) == NO:
            return NO
    return NO if e.cls != CLEARED and e.nhashes == NO else 0


cdef inline bint same(const Val *a, const Val *b) noexcept nogil:
    if a.kind != b.kind:
        return False
    if a.kind == INT:
        return a.i == b.i
    return a.kind == ABSENT or (a.n == b.n and memcmp(a.s, b.s, a.n) == 0)


cdef bint alike(const Ev *a, const Ev *b) noexcept nogil:
    """Whether ``b`` merges into ``a``'s event: removals, or GPU stores (lower-tier
    stores teach the chunk size by their own lengths), alike in every other field."""
    cdef int k
    cdef const Val *medium = &a.f[F_MEDIUM]
    if a.cls != b.cls or a.cls == CLEARED or a.size != b.size:
        return False
    if a.cls == STORED and not (
        medium.kind == ABSENT or (medium.kind == STR and named(medium.s, medium.n, b"GPU", 3))
    ):
        return False
    for k in range(F_MEDIUM, F_OWNERSHIP + 1):
        if not same(&a.f[k], &b.f[k]):
            return False
    return True


cdef inline bint same_place(const Ev *a, const Ev *b) noexcept nogil:
    """Whether two events act on one tier as sent (raw medium and group: planning's
    ``_place``): clears have no fields, so they share the place of events with none."""
    return (
        same(&a.f[F_MEDIUM], &b.f[F_MEDIUM]) and same(&a.f[F_OWNERSHIP], &b.f[F_OWNERSHIP])
        and same(&a.f[F_GROUP], &b.f[F_GROUP]) and same(&a.f[F_LOCALITY], &b.f[F_LOCALITY])
    )


cdef object value(const Val *v):
    """A field's Python value; UnicodeDecodeError if its str is no UTF-8."""
    if v.kind == ABSENT:
        return None
    if v.kind == INT:
        return PyLong_FromLongLong(v.i)
    return PyUnicode_DecodeUTF8(<const char *>v.s, v.n, NULL)


cdef int append_hashes(list out, const Ev *e) except -1:
    cdef Cur c
    cdef Py_ssize_t k
    c.p, c.end = e.hashes, e.hashes  # bounds were checked by read_hashes
    for k in range(e.nhashes):
        PyList_Append(out, hash_value(&c))
    return 0


cdef class IndexDecoder:
    """Payload -> the batch the index reads (events built from the given classes), or
    None when the msgspec path must decode it.

    ``stored(hashes, block_size, medium, group_idx, kind, window, locality,
    ownership)``, ``removed(hashes, medium, group_idx, locality, ownership)``,
    ``cleared()`` and ``batch(ts, events, data_parallel_rank)`` build the
    results; ``most`` is the most hashes an event may list (more: msgspec's
    path rejects it, and a merged event never lists more either).
    """

    cdef object stored, removed, cleared, batch
    cdef Py_ssize_t most
    cdef Ev *runs  # per merged event of the batch in hand: its first event's fields
    cdef Py_ssize_t cap

    def __init__(self, stored, removed, cleared, batch, Py_ssize_t most) -> None:
        self.stored, self.removed, self.cleared, self.batch = stored, removed, cleared, batch
        self.most = most

    def __dealloc__(self):
        PyMem_Free(self.runs)

    def __call__(self, payload):
        cdef Py_buffer view
        PyObject_GetBuffer(payload, &view, PyBUF_SIMPLE)
        try:
            return self.scan(<const uint8_t *>view.buf, view.len)
        except UnicodeDecodeError:  # a str field that is no UTF-8: msgspec says why
            return None
        finally:
            PyBuffer_Release(&view)

    cdef object scan(self, const uint8_t *data, Py_ssize_t size):
        cdef Cur c
        cdef Py_ssize_t n
        cdef double ts
        cdef int64_t rank
        cdef object dp = None
        c.p, c.end = data, data + size
        n = array_len(&c)
        if n != 2 and n != 3 or not room(&c, 9) or c.p[0] != 0xCB:
            return None
        ts = float_be(c.p + 1)
        c.p += 9
        lists = self.merged(&c)
        if lists is None:
            return None
        if n == 3:
            if room(&c, 1) and c.p[0] == 0xC0:
                c.p += 1
            elif read_int(&c, &rank) == 0:
                dp = rank
            else:
                return None
        if c.p != c.end:  # trailing bytes
            return None
        return self.batch(ts, self.built(lists, self.order(lists)), dp)

    cdef int reserve(self, Py_ssize_t n) except -1:
        cdef Ev *grown
        if n > self.cap:
            grown = <Ev *>PyMem_Realloc(self.runs, 2 * n * sizeof(Ev))
            if grown is NULL:
                raise MemoryError()
            self.runs, self.cap = grown, 2 * n
        return 0

    cdef list merged(self, Cur *c):
        """The events, alike neighbours merged: each one's hashes (None: a clear),
        its fields in ``self.runs``; None if some event is not for here."""
        cdef Py_ssize_t n = array_len(c), k, m = 0
        cdef Ev e
        cdef list lists = []
        cdef list hashes = None
        if n == NO:
            return None
        for k in range(n):
            if read_event(c, &e, self.most) == NO:
                return None
            if hashes is not None and alike(&self.runs[m - 1], &e) and (
                len(hashes) + e.nhashes <= self.most
            ):
                append_hashes(hashes, &e)
                continue
            self.reserve(m + 1)
            self.runs[m] = e
            m += 1
            hashes = [] if e.cls != CLEARED else None
            if hashes is not None:
                append_hashes(hashes, &e)
            lists.append(hashes)
        return lists

    cdef list order(self, list lists):
        """The merged events' order as planning takes them: in each stretch of events on
        one tier, the removals first where ``plan_batch`` moves them there."""
        cdef Py_ssize_t m = len(lists), i = 0, j, k
        cdef list order = []
        while i < m:
            j = i + 1
            while j < m and same_place(&self.runs[i], &self.runs[j]):
                j += 1
            if self.hoists(lists, i, j):
                order.extend([k for k in range(i, j) if self.runs[k].cls == REMOVED])
                order.extend([k for k in range(i, j) if self.runs[k].cls != REMOVED])
            else:
                order.extend(range(i, j))
            i = j
        return order

    cdef bint hoists(self, list lists, Py_ssize_t i, Py_ssize_t j) except -1:
        """``_removals_first``'s rule: a stretch of more than two runs, no clear, some
        removal, and no removal of a hash stored earlier in the stretch."""
        cdef Py_ssize_t k, runs = 1
        cdef bint removes = False
        cdef const Ev *e
        cdef set stored
        for k in range(i, j):
            e = &self.runs[k]
            if e.cls == CLEARED:
                return False
            removes |= e.cls == REMOVED
            if k > i and (e.cls != (e - 1).cls or not same(&e.f[F_KIND], &(e - 1).f[F_KIND])):
                runs += 1
        if runs <= 2 or not removes:
            return False
        stored = set()
        for k in range(i, j):
            if self.runs[k].cls != REMOVED:
                stored.update(lists[k])
            elif not stored.isdisjoint(lists[k]):
                return False
        return True

    cdef list built(self, list lists, list order):
        """The events in ``order``, alike neighbours merged again (removals moved
        together), up to ``most`` hashes each."""
        cdef list out = []
        cdef list hashes = None
        cdef Py_ssize_t k, last = 0
        for k in order:
            if hashes is not None and alike(&self.runs[last], &self.runs[k]) and (
                len(hashes) + len(<list>lists[k]) <= self.most
            ):
                hashes.extend(lists[k])
                continue
            if hashes is not None:
                out.append(self.event(&self.runs[last], hashes))
            last, hashes = k, lists[k]
            if hashes is None:
                out.append(self.cleared())
        if hashes is not None:
            out.append(self.event(&self.runs[last], hashes))
        return out

    cdef object event(self, const Ev *e, list hashes):
        cdef const Val *f = &e.f[0]
        if e.cls == REMOVED:
            return self.removed(
                hashes, value(f + F_MEDIUM), value(f + F_GROUP), value(f + F_LOCALITY),
                value(f + F_OWNERSHIP),
            )
        return self.stored(
            hashes, e.size, value(f + F_MEDIUM), value(f + F_GROUP), value(f + F_KIND),
            value(f + F_WINDOW), value(f + F_LOCALITY), value(f + F_OWNERSHIP),
        )

