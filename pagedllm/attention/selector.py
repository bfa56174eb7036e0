"""Chooses the attention backend for the platform."""

from __future__ import annotations

import torch

from pagedllm import envs
from pagedllm.attention.backends.abstract import AttentionBackend


def get_attn_backend(device: torch.device | str) -> type[AttentionBackend]:
    name = envs.PAGEDLLM_ATTENTION_BACKEND
    dev = torch.device(device)
    if name == "TRITON" or (name is None and dev.type == "cuda"):
        try:
            from pagedllm.attention.backends.triton_attn import TritonAttentionBackend  # type: ignore

            return TritonAttentionBackend
        except ImportError:
            if name == "TRITON":
                raise
    from pagedllm.attention.backends.torch_native import TorchNativeBackend

    return TorchNativeBackend
