"""Which device a run gets: 'auto' resolved, a missing GPU named. Imports torch alone, not
torch.distributed (FSDP, DTensor and their sympy cost a second): the Dagster process's preflight
(trainer/launch/preflight.py) resolves the device before every launch, on the path to the first step."""

from __future__ import annotations

import torch

from trainer.launch.config_sections import DEVICES


def resolve_device_type(device: str) -> str:
    """'auto' -> 'cuda' when a GPU is visible, else 'cpu'."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        # Never a silent CPU run: name why, since the fix differs.
        if torch.version.cuda is None:
            raise ValueError(f"device 'cuda' requested, but this torch ({torch.__version__}) is a CPU-only build; "
                             "install the CUDA build: make install TORCH_INDEX=https://download.pytorch.org/whl/cu128")
        raise ValueError(f"device 'cuda' requested, but torch {torch.__version__} (CUDA {torch.version.cuda}) sees no "
                         "CUDA device (CUDA_VISIBLE_DEVICES, driver)")
    return device
