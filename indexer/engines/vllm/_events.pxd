# cython: boundscheck=False, wraparound=False, cdivision=True
# (the inline code here compiles into each module that cimports it: with these, as in
# the .pyx beside it, not with Cython's checked defaults)
"""vLLM's events as the payload scanner reads them, by kind, declared here for the
decoder that merges and builds them."""

from libc.stdint cimport int64_t, uint8_t
from libc.string cimport memcmp

from indexer.engines.vllm._msgpack cimport Cur


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


cdef struct Ev:
    int cls
    Val f[8]  # by field number; F_HASHES and F_SIZE unused here
    int64_t size
    const uint8_t *hashes  # the first element of block_hashes
    Py_ssize_t nhashes


cdef inline bint same(const Val *a, const Val *b) noexcept nogil:
    if a.kind != b.kind:
        return False
    if a.kind == INT:
        return a.i == b.i
    return a.kind == ABSENT or (a.n == b.n and memcmp(a.s, b.s, a.n) == 0)


cdef inline bint same_place(const Ev *a, const Ev *b) noexcept nogil:
    """Whether two events act on one place: ``indexer.core.planning.place``, the raw
    medium, ownership, group and locality (clears have none of these fields, so they
    share the place of events with none)."""
    return (
        same(&a.f[F_MEDIUM], &b.f[F_MEDIUM]) and same(&a.f[F_OWNERSHIP], &b.f[F_OWNERSHIP])
        and same(&a.f[F_GROUP], &b.f[F_GROUP]) and same(&a.f[F_LOCALITY], &b.f[F_LOCALITY])
    )


cdef inline bint same_signature(const Ev *a, const Ev *b) noexcept nogil:
    """Whether two events are of one run: ``indexer.core.planning.SIGNATURE``, the class,
    the place and the kind (a removal's and a clear's is absent: their classes have none)."""
    return a.cls == b.cls and same(&a.f[F_KIND], &b.f[F_KIND]) and same_place(a, b)


cdef int read_event(Cur *c, Ev *e, Py_ssize_t most) except -2
cdef bint alike(const Ev *a, const Ev *b) noexcept nogil
cdef object value(const Val *v)
cdef int append_hashes(list out, const Ev *e) except -1
