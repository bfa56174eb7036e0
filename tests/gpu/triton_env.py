"""Where the Triton tests run: on a CUDA GPU, or on the CPU under the Triton interpreter
(TRITON_INTERPRET=1, for debugging without a GPU; its 3.6 version mishandles bfloat16)."""

from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"


def require_triton_device() -> None:
    """Skips the calling test module unless Triton imports and there is a GPU or the interpreter."""
    pytest.importorskip("triton")
    if not INTERPRET and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (or TRITON_INTERPRET=1)", allow_module_level=True)
