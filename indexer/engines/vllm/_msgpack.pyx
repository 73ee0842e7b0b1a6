# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""msgpack values the index does not read, stepped over: checked well-formed only, as
msgspec would find them (a str's UTF-8 included), else NO for the msgspec path."""

from libc.stdint cimport uint8_t


cdef extern from "Python.h":
    object PyUnicode_DecodeUTF8(const char *s, Py_ssize_t size, const char *errors)


cdef enum:
    MAX_DEPTH = 32  # nesting skipped here; deeper payloads go to msgspec


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
