"""The attention-backend interface: what the model runner builds per step and what attention layers call.

A backend is chosen by platform (see `selector.py`). The model runner fills a `CommonAttentionMetadata`
once per step per KV-cache group; the backend's builder turns it into its own metadata; each attention
layer then calls `impl.forward` with its slice of the paged KV cache.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

import torch

if TYPE_CHECKING:
    from pagedllm.attention.qkv_rope import QKVRope


class AttentionType(str, enum.Enum):
    DECODER = "decoder"
    """Causal self-attention over a paged KV cache."""
    ENCODER_ONLY = "encoder_only"
    """Bidirectional self-attention within each sequence; no KV cache."""


@dataclass
class CommonAttentionMetadata:
    """Per-step batch description, backend-independent. Requests are in persistent-batch order.

    Token i of the flattened batch belongs to request r where query_start_loc[r] <= i < query_start_loc[r+1].
    """

    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, on device
    query_start_loc_cpu: torch.Tensor  # same, on CPU
    seq_lens: torch.Tensor  # [num_reqs] int32: context length after this step's tokens, on device
    seq_lens_cpu: torch.Tensor
    num_computed_tokens_cpu: torch.Tensor  # [num_reqs] int32: tokens already in the KV cache
    block_table: torch.Tensor  # [num_reqs, max_blocks_per_req] int32, on device
    slot_mapping: torch.Tensor  # [num_tokens] int64: flat cache slot of each new token, on device
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    causal: bool = True
    kv_cache_free: bool = False
    """The profiling forward that runs before the KV cache exists (`warmup.profile_forward`): decoder attention
    runs no kernel and leaves zeros, as in vLLM's profile run. The paged kernels allocate nothing beyond their
    output, while attending within the step's tokens (SDPA) would hold [heads, n, n] scores that no real step
    holds: ~0.9 GiB of a 2,048-token sequence of Llama-3.1-8B, which the KV cache lost. Encoder-only layers
    (bidirectional, no cache) compute as in a real step."""
    key_limit: torch.Tensor | None = None
    """[num_tokens] int32 on device, or None (plain causal): the last key position each query token may see
    (>= its own position: an image's tokens see the whole image, `multimodal/runner.py`). Only a step with
    such tokens carries it; every key it names is in the cache or written this step."""
    key_limit_cpu: torch.Tensor | None = None


class AttentionMetadata(Protocol):
    """What every backend's per-step metadata carries (each backend adds its own fields)."""

    num_actual_tokens: int
    num_reqs: int
    slot_mapping: torch.Tensor
    kv_cache_free: bool


@dataclass
class RotaryArgs:
    """Neox RoPE (after Qwen3's per-head q/k RMSNorm when the weights are given) that the attention layer
    applies to q and k in place before attending. A backend whose impl has `fuses_rotary` applies it in
    the same launch as its KV-cache write; otherwise the layer applies it first (CUDA + Triton only)."""

    positions: torch.Tensor  # [T]
    cos_sin_cache: torch.Tensor  # float32 [max_positions, rotary_dim]: cos halves, then sin halves
    rotary_dim: int
    q_weight: torch.Tensor | None = None
    k_weight: torch.Tensor | None = None
    eps: float = 1e-6


class AttentionMetadataBuilder(ABC):
    def __init__(self, block_size: int, sliding_window: int | None, device: torch.device) -> None:
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.device = device

    @abstractmethod
    def build(self, common: CommonAttentionMetadata) -> AttentionMetadata: ...


M = TypeVar("M", bound=AttentionMetadata)


class AttentionImpl(ABC, Generic[M]):
    fuses_rotary: bool = False
    """True where `forward` takes `rotary=` and applies it itself (with the KV-cache write)."""
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None
    """The layer's float32 [1] K and V scales, read when the cache is FP8 (attention/kv_quant.py)."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        sliding_window: int | None,
        attn_type: AttentionType,
        logits_soft_cap: float | None = None,
    ) -> None:
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window
        self.attn_type = attn_type
        self.logits_soft_cap = logits_soft_cap or None
        """Gemma 2's attention-logit soft-capping: scores = cap * tanh(scores / cap) before the softmax."""
        self.configure()

    def configure(self) -> None:  # noqa: B027 - optional hook
        """Backend-specific set-up after the common fields are in place (e.g. reading A/B switches)."""

    def qkv_rope(self, rotary: RotaryArgs, kv_cache: torch.Tensor, attn_metadata: M) -> QKVRope | None:
        """The step's RoPE and K / V cache write for the qkv projection's kernel to do (`QKVRope`), where this
        backend reads a cache so written (`forward(..., kv_written=True)`); only backends that can say so."""
        return None

    def writes_q8_twin(self, attn_metadata: M) -> bool:
        """Whether `forward` for this step can also write its output's q8_1 twin (`forward(..., q8_twin=)`, for
        an o_proj on the GGUF int8 GEMV: quantization/act_twin.py); only backends that can say so."""
        return False

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [T, num_heads, head_size]
        key: torch.Tensor,  # [T, num_kv_heads, head_size]
        value: torch.Tensor,  # [T, num_kv_heads, head_size]
        kv_cache: torch.Tensor | None,
        attn_metadata: M,
        output: torch.Tensor,  # [T, num_heads, head_size], written in place
        rotary: RotaryArgs | None = None,  # only given to impls with fuses_rotary
        kv_written: bool = False,  # q rotated and the new K / V in the cache already (`qkv_rope`)
    ) -> torch.Tensor: ...


class AttentionBackend(ABC):
    name: str = "abstract"
    supports_cuda_graphs: bool = False
    """Whether a pure-decode step can be captured: every tensor the kernels read lives in fixed-shape
    buffers the runner can keep, and the launch depends only on host ints fixed per batch size."""

    @staticmethod
    @abstractmethod
    def get_impl_cls() -> type[AttentionImpl]: ...

    @staticmethod
    @abstractmethod
    def get_builder_cls() -> type[AttentionMetadataBuilder]: ...

    @staticmethod
    @abstractmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]: ...
