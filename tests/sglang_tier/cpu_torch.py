"""What SGLang needs to import beside a CPU build of torch.

SGLang's model configs import torchvision's transforms when its cache module
loads; PyPI's torchvision is built against CUDA torch, so its operators never
register beside the CPU build and its meta registrations for ``nms`` and
``qnms`` fail at import. Declaring those two schemas first lets it import; the
radix cache and the event publisher call none of torchvision.
"""

from __future__ import annotations

import torch

_LIBRARY = torch.library.Library("torchvision", "DEF")
for _op in ("nms", "qnms"):
    _LIBRARY.define(f"{_op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
