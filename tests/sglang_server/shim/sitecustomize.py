"""Runs at the start of every Python process of the SGLang server tier (PYTHONPATH).

PyPI's torchvision is built against CUDA torch: beside the CPU build its ``nms`` and ``qnms``
operators never register and ``import torchvision`` fails, which fails transformers' model
imports and SGLang's configs. Their schemas are declared, as tests/sglang_tier/cpu_torch.py
does, when torchvision is first imported (torch is not imported before).
"""

import importlib.abc
import sys


class _DeclareTorchvisionOps(importlib.abc.MetaPathFinder):
    library = None

    def find_spec(self, name, path=None, target=None):
        if name == "torchvision" and _DeclareTorchvisionOps.library is None:
            import torch

            library = torch.library.Library("torchvision", "DEF")
            for op in ("nms", "qnms"):
                library.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            _DeclareTorchvisionOps.library = library
        return None


sys.meta_path.insert(0, _DeclareTorchvisionOps())
