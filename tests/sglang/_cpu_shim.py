"""Let SGLang import on a CPU-only host; imported by conftest before anything imports sglang or
transformers (and by the subprocess that loads the plugin the way SGLang does).

PyPI's torchvision wheel is a CUDA build: its C++ extension cannot load against the CPU build of
torch, and torchvision/_meta_registrations.py then fails on its unconditional
``register_fake("torchvision::nms")`` ("operator torchvision::nms does not exist"), which breaks
even ``import sglang`` (through transformers' image utilities). SGLang's configs need only
torchvision's pure-Python parts (transforms). So, if importing torchvision fails that way, the
nms/qnms schemas are defined and torchvision imported again: the Python parts then work, the C++
ops stay unavailable. Where torchvision imports normally (or is absent) this does nothing.
"""

from __future__ import annotations

import sys

import torch

_lib: torch.library.Library | None = None  # kept alive: dropping it would undefine the ops


def apply() -> None:
    global _lib
    try:
        import torchvision
    except ImportError:
        return  # not installed: nothing to fix
    except RuntimeError as exc:
        if "torchvision::nms" not in str(exc):
            raise
    else:
        return
    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        del sys.modules[name]
    _lib = torch.library.Library("torchvision", "FRAGMENT")
    _lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    import torchvision  # noqa: F401


apply()
