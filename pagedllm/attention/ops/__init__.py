"""Custom attention kernels (Triton). Importing this package never touches a GPU."""

from pagedllm.attention.ops.triton_paged_attn import HAS_TRITON, paged_attention, reshape_and_cache

__all__ = ["HAS_TRITON", "paged_attention", "reshape_and_cache"]
