"""vLLM's token-chain hashing, compiled (``_chainhash``), and whether it built.

Without the build :mod:`indexer.engines.vllm.hashing` runs its pure-Python
reference: the same hashes, many times slower. ``tests/test_native.py`` fails
the run when the build is missing, so CI always tests the compiled core.
"""

from __future__ import annotations

from indexer.compiled import CompiledModule

PART = CompiledModule(
    "indexer.engines.vllm._chainhash",
    "compiled core not in use: kvindex runs its pure-Python reference, many times "
    "slower; reinstall with a C compiler and OpenSSL headers (pip install -e .)",
)
#: The compiled token-chain hashing module, or None when it did not build or load.
chainhash = PART.module
