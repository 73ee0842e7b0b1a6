# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""vLLM's token-chain block hashing in C: serialise each block, digest it, chain on.

Each block ``i`` is ``(parent, tokens_i, extra_keys_i)`` serialised as vLLM
does (pickle protocol 5, or canonical CBOR) and digested (SHA-256 from
OpenSSL's libcrypto, or XXH3-128 from xxhash's header, compiled in).
``indexer.engines.vllm.hashing`` holds the pure-Python reference these bytes
must equal; this module writes the same bytes without building a Python
object per block. The caller serialises each block's extra keys once
(``fragments``), already in the form they take inside the block, because
they repeat across blocks and are rare to need: tokens are what is hot. For an
engine hashing with lookahead (each block's extra keys followed by the tokens
after it) those tokens are written here too: they differ for every block.

A block this module does not encode (a token that is not a plain ``int`` in
the int64 range, or a pickle too large for one frame) is handed back to the
caller's ``fallback`` so exactness never depends on what is implemented here.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.list cimport PyList_GET_SIZE, PyList_New, PyList_SET_ITEM
from cpython.long cimport PyLong_FromUnsignedLongLong
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.ref cimport Py_INCREF, PyObject
from cpython.sequence cimport PySequence_Fast_ITEMS
from libc.stdint cimport int64_t, uint8_t, uint64_t
from libc.string cimport memcpy


cdef extern from "openssl/sha.h" nogil:
    ctypedef struct SHA256_CTX:
        pass
    int SHA256_Init(SHA256_CTX *ctx)
    int SHA256_Update(SHA256_CTX *ctx, const void *data, size_t length)
    int SHA256_Final(unsigned char *md, SHA256_CTX *ctx)


cdef enum Serial:
    PICKLE
    CBOR


cdef enum Digest:
    SHA256
    XXH3_128


#: What each of vLLM's ``--prefix-caching-hash-algo`` names serialises and digests with.
ALGOS = {
    "sha256": (PICKLE, SHA256),
    "sha256_cbor": (CBOR, SHA256),
    "xxhash": (PICKLE, XXH3_128),
    "xxhash_cbor": (CBOR, XXH3_128),
}


cdef extern from *:
    """
    /* XXH3-128 inlined from the header: no library to link or find at run time. */
    #define XXH_INLINE_ALL
    #include <xxhash.h>

    /* The digest as xxhash's xxh3_128_digest gives it: high then low half, big-endian. */
    static inline void kv_xxh3_128(unsigned char *digest, const void *data, size_t length) {
        XXH128_canonicalFromHash((XXH128_canonical_t *)digest, XXH3_128bits(data, length));
    }

    /* A token's value if it is a plain int in the int64 range; 0 if not.
       Reads one-digit ints (every token id) in place, as CPython's own fast paths do. */
    static inline int kv_token(PyObject *o, int64_t *out) {
        if (!PyLong_CheckExact(o)) return 0;
    #if PY_VERSION_HEX >= 0x030C0000
        if (PyUnstable_Long_IsCompact((PyLongObject *)o)) {
            *out = PyUnstable_Long_CompactValue((PyLongObject *)o);
            return 1;
        }
    #else
        Py_ssize_t size = Py_SIZE(o);
        if (size >= -1 && size <= 1) {
            *out = size * (int64_t)((PyLongObject *)o)->ob_digit[0];
            return 1;
        }
    #endif
        int overflow;
        *out = PyLong_AsLongLongAndOverflow(o, &overflow);
        return !overflow;
    }
    """
    bint kv_token(PyObject *o, int64_t *out)
    void kv_xxh3_128(unsigned char *digest, const void *data, size_t length) nogil
    int __builtin_clzll(unsigned long long value) nogil


cdef enum:
    # pickle opcodes of protocol 5 (the stdlib's names)
    OP_PROTO = 0x80
    OP_FRAME = 0x95
    OP_SHORT_BINBYTES = 0x43
    OP_MEMOIZE = 0x94
    OP_MARK = 0x28
    OP_TUPLE = 0x74
    OP_TUPLE1 = 0x85
    OP_TUPLE3 = 0x87
    OP_BININT1 = 0x4B
    OP_BININT2 = 0x4D
    OP_BININT = 0x4A
    OP_LONG1 = 0x8A
    OP_STOP = 0x2E
    # The pickler closes a frame once it holds 64 KiB and opens another; we write one frame.
    PICKLE_FRAME_TARGET = 65536
    # bytes before the frame's contents: PROTO 5, FRAME and its 8-byte length
    PICKLE_HEADER = 11
    # the most a token takes: LONG1, a length byte, 9 bytes written (8 kept at most)
    MAX_TOKEN_BYTES = 11
    # the most a block's fixed parts take besides tokens, extra keys and parent
    # (the lookahead tuple's own opcodes or CBOR head included)
    BLOCK_OVERHEAD = 32
    # CBOR major types
    CBOR_UINT = 0
    CBOR_NEGINT = 1
    CBOR_BYTES = 2
    CBOR_ARRAY = 4


cdef inline uint8_t* put_le(uint8_t* out, uint64_t value, int width) noexcept nogil:
    cdef int i
    for i in range(width):
        out[i] = <uint8_t>(value >> (8 * i))
    return out + width


cdef inline uint8_t* put_be(uint8_t* out, uint64_t value, int width) noexcept nogil:
    cdef int i
    for i in range(width):
        out[i] = <uint8_t>(value >> (8 * (width - 1 - i)))
    return out + width


cdef inline uint8_t* pickle_int(uint8_t* out, int64_t value) noexcept nogil:
    """The pickler's choice: BININT1/BININT2 for small non-negative ints, BININT for
    anything in int32, else LONG1 with the fewest two's complement bytes."""
    cdef uint64_t magnitude
    cdef int nbytes
    if 0 <= value <= 0xFF:
        out[0] = OP_BININT1
        out[1] = <uint8_t>value
        return out + 2
    if 0 <= value <= 0xFFFF:
        out[0] = OP_BININT2
        return put_le(out + 1, <uint64_t>value, 2)
    if -0x80000000 <= value <= 0x7FFFFFFF:
        out[0] = OP_BININT
        return put_le(out + 1, <uint64_t>value, 4)
    # As the pickler: bit length of |value| // 8 + 1 bytes, one fewer when a negative
    # value's top byte is only sign extension.
    magnitude = <uint64_t>value if value >= 0 else (<uint64_t>0) - <uint64_t>value
    nbytes = ((64 - __builtin_clzll(magnitude)) >> 3) + 1
    out[0] = OP_LONG1
    put_le(out + 2, <uint64_t>value, 8)
    if nbytes == 9:
        out[10] = 0xFF if value < 0 else 0
    if value < 0 and nbytes > 1 and out[1 + nbytes] == 0xFF and (out[nbytes] & 0x80):
        nbytes -= 1
    out[1] = <uint8_t>nbytes
    return out + 2 + nbytes


cdef inline uint8_t* cbor_head(uint8_t* out, uint8_t major, uint64_t arg) noexcept nogil:
    """A data item's head in its shortest form, as canonical CBOR requires."""
    cdef uint8_t kind = major << 5
    if arg < 24:
        out[0] = kind | <uint8_t>arg
        return out + 1
    if arg <= 0xFF:
        out[0] = kind | 24
        return put_be(out + 1, arg, 1)
    if arg <= 0xFFFF:
        out[0] = kind | 25
        return put_be(out + 1, arg, 2)
    if arg <= 0xFFFFFFFFU:
        out[0] = kind | 26
        return put_be(out + 1, arg, 4)
    out[0] = kind | 27
    return put_be(out + 1, arg, 8)


cdef inline uint8_t* cbor_int(uint8_t* out, int64_t value) noexcept nogil:
    if value >= 0:
        return cbor_head(out, CBOR_UINT, <uint64_t>value)
    return cbor_head(out, CBOR_NEGINT, <uint64_t>(-1 - value))


cdef inline uint8_t* put_bytes(uint8_t* out, const uint8_t* data, Py_ssize_t length) noexcept nogil:
    memcpy(out, data, length)
    return out + length


cdef inline uint8_t* pickle_ints(uint8_t* out, PyObject** tokens, Py_ssize_t n) noexcept:
    """The tokens as the pickler writes them inside a tuple; NULL if one is not encodable here."""
    cdef Py_ssize_t i
    cdef int64_t value
    for i in range(n):
        if not kv_token(tokens[i], &value):
            return NULL
        out = pickle_int(out, value)
    return out


cdef inline uint8_t* pickle_tuple_open(uint8_t* out, Py_ssize_t n) noexcept nogil:
    """What precedes a tuple's ``n`` items: a MARK past three (TUPLE1-3 need none)."""
    if n > 3:
        out[0] = OP_MARK
        out += 1
    return out


cdef inline uint8_t* pickle_tuple_close(uint8_t* out, Py_ssize_t n) noexcept nogil:
    """What follows a tuple's ``n`` items: TUPLE (or TUPLE1-3), then its memo slot."""
    out[0] = OP_TUPLE if n > 3 else OP_TUPLE1 + n - 1
    out[1] = OP_MEMOIZE
    return out + 2


cdef uint8_t* pickle_lookahead(
    uint8_t* out, bytes fragment, PyObject** tokens, Py_ssize_t lookahead
) noexcept:
    """The tuple ``(keys, *tokens)``, ``fragment`` holding ``keys``; NULL if not encodable
    here."""
    out = pickle_tuple_open(out, lookahead + 1)
    out = put_bytes(out, <const uint8_t*>PyBytes_AS_STRING(fragment), PyBytes_GET_SIZE(fragment))
    out = pickle_ints(out, tokens, lookahead)
    return NULL if out == NULL else pickle_tuple_close(out, lookahead + 1)


cdef inline Py_ssize_t pickle_block(
    uint8_t* buf, const uint8_t* parent, Py_ssize_t parent_len,
    PyObject** tokens, Py_ssize_t size, bytes fragment, Py_ssize_t lookahead,
) noexcept:
    """Write ``pickle.dumps((parent, tokens, extra), protocol=5)``; -1 if not encodable here
    (inline and noexcept: the loop over blocks runs it as straight code, no call).

    With ``lookahead`` (L > 0) ``extra`` is the tuple ``(keys, *next L tokens)``
    whose ``keys`` the fragment holds. Memo slots are taken in order: 0 the
    parent, 1 the token tuple, then the extra keys' own (the fragment's memo
    references already count from 2: a tuple takes its slot after its items).
    """
    cdef uint8_t* out = buf + PICKLE_HEADER
    cdef Py_ssize_t length
    out[0] = OP_SHORT_BINBYTES
    out[1] = <uint8_t>parent_len
    out = put_bytes(out + 2, parent, parent_len)
    out[0] = OP_MEMOIZE
    out = pickle_ints(pickle_tuple_open(out + 1, size), tokens, size)
    if out == NULL:
        return -1
    out = pickle_tuple_close(out, size)
    if lookahead:
        out = pickle_lookahead(out, fragment, tokens + size, lookahead)
        if out == NULL:
            return -1
    else:
        out = put_bytes(out, <const uint8_t*>PyBytes_AS_STRING(fragment), PyBytes_GET_SIZE(fragment))
    out[0] = OP_TUPLE3
    out[1] = OP_MEMOIZE
    out[2] = OP_STOP
    out += 3
    length = out - buf
    if length - PICKLE_HEADER >= PICKLE_FRAME_TARGET:
        return -1
    buf[0] = OP_PROTO
    buf[1] = 5
    buf[2] = OP_FRAME
    put_le(buf + 3, <uint64_t>(length - PICKLE_HEADER), 8)
    return length


cdef inline uint8_t* cbor_ints(uint8_t* out, PyObject** tokens, Py_ssize_t n) noexcept:
    """The tokens as canonical CBOR items; NULL if one is not encodable here."""
    cdef Py_ssize_t i
    cdef int64_t value
    for i in range(n):
        if not kv_token(tokens[i], &value):
            return NULL
        out = cbor_int(out, value)
    return out


cdef Py_ssize_t cbor_block(
    uint8_t* buf, const uint8_t* parent, Py_ssize_t parent_len,
    PyObject** tokens, Py_ssize_t size, bytes fragment, Py_ssize_t lookahead,
):
    """Write ``cbor2.dumps((parent, tokens, extra), canonical=True)``; -1 if not encodable
    here. With ``lookahead`` (L > 0) ``extra`` is ``(keys, *next L tokens)``, ``keys``
    the fragment."""
    cdef uint8_t* out = cbor_head(buf, CBOR_ARRAY, 3)
    out = cbor_head(out, CBOR_BYTES, <uint64_t>parent_len)
    out = put_bytes(out, parent, parent_len)
    out = cbor_ints(cbor_head(out, CBOR_ARRAY, <uint64_t>size), tokens, size)
    if out == NULL:
        return -1
    if lookahead:
        out = cbor_head(out, CBOR_ARRAY, <uint64_t>(lookahead + 1))
    out = put_bytes(out, <const uint8_t*>PyBytes_AS_STRING(fragment), PyBytes_GET_SIZE(fragment))
    if lookahead:
        out = cbor_ints(out, tokens + size, lookahead)
        if out == NULL:
            return -1
    return out - buf


cdef inline void sha256_into(uint8_t* digest, const uint8_t* data, Py_ssize_t length) noexcept nogil:
    cdef SHA256_CTX ctx
    SHA256_Init(&ctx)
    SHA256_Update(&ctx, data, length)
    SHA256_Final(digest, &ctx)


cdef inline uint64_t low_64(const uint8_t* digest, Py_ssize_t length) noexcept nogil:
    """What vLLM publishes for a digest: its last 8 bytes (all, if fewer), big-endian."""
    cdef uint64_t value = 0
    cdef Py_ssize_t i
    for i in range(max(length - 8, 0), length):
        value = (value << 8) | digest[i]
    return value


def chain(
    str algo,
    bytes none_hash,
    tokens,
    Py_ssize_t size,
    list fragments,
    bint as_ints,
    fallback,
    Py_ssize_t lookahead=0,
):
    """``algo``'s chained digests of ``len(fragments)`` full blocks of ``size`` tokens.

    ``tokens``: a list or tuple of them. ``fragments[i]``: block ``i``'s extra keys as
    they appear serialised inside its tuple. With ``lookahead`` (L > 0) block ``i``'s
    extra keys are ``(keys_i, *the L tokens after it)``, ``fragments[i]`` serialising
    ``keys_i``: the tokens are written here, as the block's own are, since they
    differ for every block. ``fallback(i, parent)`` returns
    block ``i``'s digest (bytes) when this module cannot encode it. With
    ``as_ints`` each digest is returned as vLLM publishes it (low 64 bits).
    """
    cdef Py_ssize_t n_blocks = PyList_GET_SIZE(fragments)
    cdef Py_ssize_t i, length, digest_len = len(none_hash), widest = 0
    cdef PyObject** items
    cdef uint8_t parent[32]
    cdef uint8_t* buf
    cdef bytes fragment, digested
    cdef list out = []
    cdef Serial serial
    cdef Digest digest
    serial, digest = ALGOS[algo]
    if lookahead < 0:
        raise ValueError(f"lookahead must not be negative, got {lookahead}")
    if n_blocks and n_blocks * size + lookahead > len(tokens):
        raise ValueError(
            f"{n_blocks} blocks of {size} and {lookahead} more need more than {len(tokens)} tokens"
        )
    if digest_len > 32:
        raise ValueError(f"a {digest_len}-byte parent digest is not one this module makes")
    for i in range(n_blocks):
        fragment = fragments[i]
        widest = max(widest, PyBytes_GET_SIZE(fragment))
    if type(tokens) is not list and type(tokens) is not tuple:
        raise TypeError(f"tokens must be a list or tuple, not {type(tokens).__name__}")
    items = PySequence_Fast_ITEMS(tokens)
    buf = <uint8_t*>PyMem_Malloc(PICKLE_HEADER + BLOCK_OVERHEAD + digest_len + widest
                                 + (size + lookahead) * MAX_TOKEN_BYTES)
    if buf == NULL:
        raise MemoryError()
    memcpy(parent, PyBytes_AS_STRING(none_hash), digest_len)
    try:
        for i in range(n_blocks):
            fragment = fragments[i]
            if serial == PICKLE:
                length = pickle_block(
                    buf, parent, digest_len, items + i * size, size, fragment, lookahead
                )
            else:
                length = cbor_block(
                    buf, parent, digest_len, items + i * size, size, fragment, lookahead
                )
            if length < 0:
                digested = fallback(i, PyBytes_FromStringAndSize(<const char*>parent, digest_len))
                memcpy(parent, PyBytes_AS_STRING(digested), digest_len)
            elif digest == SHA256:
                sha256_into(parent, buf, length)
            else:
                kv_xxh3_128(parent, buf, length)
            if as_ints:
                out.append(PyLong_FromUnsignedLongLong(low_64(parent, digest_len)))
            else:
                out.append(PyBytes_FromStringAndSize(<const char*>parent, digest_len))
    finally:
        PyMem_Free(buf)
    return out


def published(list digests):
    """Each digest as vLLM publishes it, its low 64 bits (last 8 bytes, big-endian): a
    tokens query asks this of every digest it matches engines publishing ints with."""
    cdef Py_ssize_t i, n = PyList_GET_SIZE(digests)
    cdef list out = PyList_New(n)
    cdef bytes digest
    for i in range(n):
        digest = digests[i]
        item = PyLong_FromUnsignedLongLong(
            low_64(<const uint8_t*>PyBytes_AS_STRING(digest), PyBytes_GET_SIZE(digest))
        )
        Py_INCREF(item)  # SET_ITEM steals a reference: the list's own
        PyList_SET_ITEM(out, i, item)
    return out
