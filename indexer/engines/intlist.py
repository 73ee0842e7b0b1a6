"""Whether GET prompts' decimal lists are read in C (``_intlist``), and if not, why.

The reader is a Cython module built at install time. Without it
:mod:`api.parsing` reads them through msgspec's JSON decoder: the same lists and
the same errors, only slower, so a missing build is said on start and in
``/stats`` like every compiled part. ``tests/test_parsing.py`` fails the run when
the build is missing.
"""

from __future__ import annotations

from indexer.compiled import CompiledModule

PART = CompiledModule(
    "indexer.engines._intlist",
    "compiled decimal-list reader not in use: GET prompts are parsed through msgspec's "
    "JSON decoder, slower; reinstall with a C compiler (pip install -e .)",
)
