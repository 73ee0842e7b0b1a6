# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""A comma-separated list of decimals (a GET prompt's tokens or block hashes) read in C.

A GET prompt of 8k tokens is 50 KB of text; a JSON decoder reads it about five
times slower than one pass over its bytes, and ``str.split`` plus ``int`` slower
still. This reads the text's bytes once, into a list of ints sized beforehand.

It takes exactly what the strict per-item rule takes (every item 1 to
``max_digits`` ASCII digits, leading zeros allowed, at most ``ceiling``) and
answers None for anything else: the caller's Python path then walks the items
to name the bad one, so the errors never depend on this module.
"""

from cpython.list cimport PyList_New, PyList_SET_ITEM
from cpython.long cimport PyLong_FromUnsignedLongLong
from cpython.ref cimport Py_INCREF
from libc.stdint cimport uint64_t


cdef extern from "Python.h":
    const char* PyUnicode_AsUTF8AndSize(object text, Py_ssize_t* size) except NULL


cdef enum:
    SAFE_DIGITS = 19  # any 19 digits fit in a uint64: only a 20th can overflow it


cdef inline bint takes(uint64_t v, uint64_t digit, int digits, int max_digits, uint64_t ceiling
                       ) noexcept nogil:
    """Whether ``digit`` may follow the ``digits`` digits of ``v`` (the rare case: a
    byte that is no digit, or an item past the 19 digits any uint64 holds)."""
    return digit <= 9 and digits < max_digits and v <= (ceiling - digit) // 10


cdef Py_ssize_t fill(
    list out, const char* data, Py_ssize_t size, int max_digits, uint64_t ceiling
) except -2:
    """Each item's int into ``out``'s slots; -1 at the first bad item (``out`` then
    holds ints up to there and NULL after), else how many were filled."""
    cdef Py_ssize_t i, n = 0
    cdef uint64_t v = 0, digit
    cdef int digits = 0
    for i in range(size + 1):
        if i == size or data[i] == b",":
            if digits == 0 or v > ceiling:
                return -1
            put(out, n, v)
            n, v, digits = n + 1, 0, 0
            continue
        digit = <unsigned char>data[i] - <unsigned char>b"0"
        if (digit > 9 or digits >= SAFE_DIGITS) and not takes(v, digit, digits, max_digits, ceiling):
            return -1
        v = v * 10 + digit
        digits += 1
    return n


cdef inline int put(list out, Py_ssize_t i, uint64_t v) except -1:
    item = PyLong_FromUnsignedLongLong(v)
    Py_INCREF(item)  # SET_ITEM steals a reference: the list's own
    PyList_SET_ITEM(out, i, item)
    return 0


def decimals(str text, int max_digits, uint64_t ceiling):
    """``text``'s items as ints (``""``: none), or None if any item is not
    1..``max_digits`` ASCII digits of a value at most ``ceiling``."""
    cdef Py_ssize_t size, n
    cdef const char* data
    cdef list out
    if not text:
        return []
    if not text.isascii():  # O(1) for a str; its UTF-8 is then its own bytes, no copy
        return None
    data = PyUnicode_AsUTF8AndSize(text, &size)
    out = PyList_New(count_items(data, size))  # filled before it is seen, or dropped
    n = fill(out, data, size, max_digits, ceiling)
    if n < 0:
        del out[:]  # unfilled slots are NULL: empty it before it goes
        return None
    return out


cdef Py_ssize_t count_items(const char* data, Py_ssize_t size) noexcept nogil:
    cdef Py_ssize_t i, n = 1
    for i in range(size):
        n += data[i] == b","
    return n
