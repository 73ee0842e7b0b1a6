"""The compiled core: Cython modules built with the machine's C compiler.

Metadata lives in pyproject.toml; this file only declares the extensions,
which setuptools cannot take from pyproject.toml alone.
"""

from Cython.Build import cythonize
from setuptools import Extension, setup

# SHA-256 from OpenSSL's libcrypto (the one Python's hashlib uses); its low-level
# SHA256_* calls are deprecated in OpenSSL 3 yet are the ones without a per-call
# algorithm lookup. XXH3 is inlined from xxhash.h (Debian's libxxhash-dev): calling
# the xxhash package per block instead measured 1.5x slower (6.1 against 4.2 us per
# 1k tokens).
LIBCRYPTO = {"libraries": ["crypto"], "define_macros": [("OPENSSL_SUPPRESS_DEPRECATED", None)]}

# Each module, with what it links beyond Python. The parts of one core cimport each
# other's .pxd declarations, so their calls stay C calls across modules.
MODULES = {
    "indexer.engines.vllm._chainhash": LIBCRYPTO,
    # the embedded store's holder index (_holders is its public face) and its parts
    "indexer.stores.memory._ranksets": {},
    "indexer.stores.memory._tables": {},
    "indexer.stores.memory._walk": {},
    "indexer.stores.memory._hybrid": {},
    "indexer.stores.memory._slots": {},
    "indexer.stores.memory._answers": {},
    "indexer.stores.memory._holders": {},
    # vLLM batch payloads scanned for the index without a Python object per field:
    # msgpack primitives, the events by kind, the decoder (_frames) that builds batches
    "indexer.engines.vllm._msgpack": {},
    "indexer.engines.vllm._events": {},
    "indexer.engines.vllm._frames": {},
    # GET prompts' comma-separated decimals read into ints in one pass
    "indexer.engines._intlist": {},
}

setup(
    ext_modules=cythonize(
        [
            Extension(name, [name.replace(".", "/") + ".pyx"], extra_compile_args=["-O3"], **extra)
            for name, extra in MODULES.items()
        ],
        language_level=3,
    )
)
