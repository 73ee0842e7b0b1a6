# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""vLLM's events read by kind (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``):
the fields each kind has that the index reads, the others skipped unread, and
which neighbours merge into one event (their hashes concatenated)."""

from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.list cimport PyList_Append
from cpython.long cimport PyLong_FromLongLong, PyLong_FromUnsignedLongLong
from libc.stdint cimport uint8_t
from libc.string cimport memcmp, strlen

from indexer.engines.vllm._msgpack cimport (
    NO, Cur, array_len, be, hash_item, map_len, read_int, read_str, room, skip,
)


cdef extern from "Python.h":
    object PyUnicode_DecodeUTF8(const char *s, Py_ssize_t size, const char *errors)


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


cdef bint alike(const Ev *a, const Ev *b) noexcept nogil:
    """Whether ``b`` merges into ``a``'s event (``indexer.core.planning.merge_key``):
    removals, or GPU stores (lower-tier stores teach the chunk size by their own
    lengths), alike in every other field."""
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
