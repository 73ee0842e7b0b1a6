# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""vLLM 0.33 batch payloads scanned in C for the index: the fields it reads, no others.

msgspec builds a struct per event and a Python object per field it keeps. A
vLLM GPU pool evicts one block per ``BlockRemoved``, so a batch holds hundreds
of one-hash events, and building them was most of ingest. This scanner reads a
payload once, skips token ids and every other field the index does not read
(checking only that they are well-formed msgpack), and builds one event per
stretch of consecutive events alike in every field but their hashes (GPU
stores and removals: ``indexer.core.planning.merge_key``'s rule), their hashes
concatenated: the index counts them the same.

It takes only what it is sure msgspec takes, and answers None for anything else
(legacy positional events, encodings vLLM never writes, any malformation): the
msgspec path then decodes it and raises its errors. So it accepts and rejects
exactly what that path does, and gives what ``indexer.core.planning.indexed_events``
makes of msgspec's events (``tests/test_frames.py`` checks it against both).

It gives the events in planning order, the one order every reader of a batch takes:
``indexer.core.planning``'s rule (``plan_batch`` runs it, and so does
``indexed_events``), here in C condition by condition (:meth:`IndexDecoder.removals_move`), on
the merged events, which are then merged again. In C because that rule in Python,
applied to this scanner's events in wire order and merged again, took 30 ms a
pass of bench item 1's quick stream (640 batches, 29k merged events) where the C
takes 4 ms and the rest of the scan 32 ms: decode and apply 37% slower.
``tests/test_planning.py`` and ``tests/test_frames.py`` check that both give the
same batches.

The scanner's parts: msgpack read in place (``_msgpack``), vLLM's events by kind
(``_events``), and here the decoder that merges them into the index's batch; each
``.pxd`` declares what the next cimports, so their calls stay C calls.
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.mem cimport PyMem_Free, PyMem_Realloc
from libc.stdint cimport int64_t, uint8_t

from indexer.engines.vllm._events cimport (
    CLEARED, F_GROUP, F_KIND, F_LOCALITY, F_MEDIUM, F_OWNERSHIP, F_WINDOW, REMOVED, Ev, Val,
    alike, append_hashes, read_event, same_place, same_signature, value,
)
from indexer.engines.vllm._msgpack cimport NO, Cur, array_len, float_be, read_int, room


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
        """The merged events' order as planning takes them (``planned_runs``): in each
        stretch of events on one place, the removals first where ``removals_move``
        moves them there (removals, then stores, each in order)."""
        cdef Py_ssize_t m = len(lists), i = 0, j, k
        cdef list order = []
        while i < m:
            j = i + 1
            while j < m and same_place(&self.runs[i], &self.runs[j]):
                j += 1
            if self.removals_move(lists, i, j):
                order.extend([k for k in range(i, j) if self.runs[k].cls == REMOVED])
                order.extend([k for k in range(i, j) if self.runs[k].cls != REMOVED])
            else:
                order.extend(range(i, j))
            i = j
        return order

    cdef bint removals_move(self, list lists, Py_ssize_t i, Py_ssize_t j) except -1:
        """``removals_move`` on the stretch of merged events ``i`` to ``j - 1``: more than
        two runs, no clear, some removal after a store, and no removal of a hash that
        an earlier store of the stretch stored. Merged events of one run are alike in
        signature, so runs are counted where the signature changes; a removal before
        the stretch's first store removes nothing stored before it."""
        cdef Py_ssize_t k, runs = 1, first_store = j
        cdef bint removal_after_store = False
        cdef const Ev *e
        cdef set stored
        for k in range(i, j):
            e = &self.runs[k]
            if e.cls == CLEARED:
                return False
            if k > i and not same_signature(e - 1, e):
                runs += 1
            if e.cls != REMOVED:
                first_store = min(first_store, k)
            elif first_store < j:
                removal_after_store = True
        if runs <= 2 or not removal_after_store:
            return False
        stored = set()
        for k in range(first_store, j):
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
