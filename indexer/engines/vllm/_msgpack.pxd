# cython: boundscheck=False, wraparound=False, cdivision=True
# (the inline code here compiles into each module that cimports it: with these, as in
# the .pyx beside it, not with Cython's checked defaults)
"""msgpack read in place: the primitives every part of the payload scanner cimports,
inline, so reading a value costs no call."""

from libc.stdint cimport int64_t, uint8_t, uint64_t
from libc.string cimport memcpy


cdef enum:
    NO = -1  # not taken here: the msgspec path decodes it


cdef struct Cur:
    const uint8_t *p
    const uint8_t *end


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


cdef int skip(Cur *c, int depth) except -2
