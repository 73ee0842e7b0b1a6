"""Not SGLang's code: a stand-in for the CPU build of ``sgl-kernel`` (kvindex's own).

SGLang 0.5.23 with ``SGLANG_USE_CPU_ENGINE=1`` imports CPU operators from ``sgl_kernel`` at
module level (``copy_all_layer_kv_cache_cpu``, ``assign_req_to_token_pool_cpu``, the
speculative-decoding ``*_cpu`` ones). They come from sgl-kernel built from source with
``pyproject_cpu.toml`` (``csrc/cpu``, ``-march=native``, libnuma): PyPI has no CPU build
(``sglang-kernel`` 0.4.10 is CUDA 13 only: its ``common_ops`` needs ``libnvrtc.so.13`` and has
none of the CPU operators) and no source distribution of sglang or sglang-kernel 0.5.23/0.4.10.

On a CPU without AMX (this machine's), SGLang falls back to its ``torch_native`` attention
and calls none of these on the path the tier drives (a text model, no speculative decoding):
every name here is a function that says so on stderr and raises if called, and the tier
fails if the server's log shows a call.
"""

import sys

__version__ = "0.0.0+kvindex-shim"


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args, **kwargs):
        print(f"[sgl_kernel shim] CALLED {name}", file=sys.stderr, flush=True)
        raise NotImplementedError(
            f"sgl_kernel.{name}: the CPU build of sgl-kernel is not installed"
        )

    missing.__name__ = name
    return missing
