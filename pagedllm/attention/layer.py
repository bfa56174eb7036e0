"""The attention layer models use: projects nothing, just routes q/k/v to the chosen backend."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm import envs
from pagedllm.attention.backends.abstract import AttentionType, RotaryArgs
from pagedllm.attention.qkv_rope import QKVRope
from pagedllm.attention.selector import get_attn_backend
from pagedllm.forward_context import get_attn_metadata, get_split_hook
from pagedllm.model_executor.layers.quantization import act_twin


class Attention(nn.Module):
    """`kv_cache` is bound by the model runner after it allocates the cache (None until then).

    With `PAGEDLLM_ATTN_Q8_TWIN` (default on), a producer of activation twins (quantization/act_twin.py) where the model
    links it to its o_proj: for a GGUF o_proj on the int8 GEMV, a backend that can (`writes_q8_twin`) writes
    the output's q8_1 twin.

    `prefix` must be unique per layer (e.g. "model.layers.3.self_attn.attn"): the model runner finds
    every Attention module by name to bind its cache and its per-step metadata.
    """

    @property
    def twin_kinds(self) -> tuple[str, ...]:
        """The twins it can write (`act_twin.link_producers`): "q8", unless switched off."""
        return ("q8",) if envs.PAGEDLLM_ATTN_Q8_TWIN else ()

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        sliding_window: int | None = None,
        attn_type: AttentionType = AttentionType.DECODER,
        prefix: str = "",
        logits_soft_cap: float | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads or num_heads
        self.sliding_window = sliding_window
        self.attn_type = attn_type
        self.layer_name = prefix
        self.kv_cache: torch.Tensor | None = None
        self.backend = get_attn_backend(torch.get_default_device())
        self.impl = self.backend.get_impl_cls()(
            num_heads, head_size, scale, self.num_kv_heads, sliding_window, attn_type, logits_soft_cap
        )
        # FP8 KV cache (attention/kv_quant.py): cache = fp8(x / scale); read only when the cache is FP8.
        k_scale = torch.ones(1, dtype=torch.float32)
        v_scale = torch.ones(1, dtype=torch.float32)
        self.register_buffer("k_scale", k_scale, persistent=False)
        self.register_buffer("v_scale", v_scale, persistent=False)
        self.impl.kv_scales = (k_scale, v_scale)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rotary: RotaryArgs | None = None,
        kv_written: bool = False,
    ) -> torch.Tensor:
        """q: [T, num_heads*head_size], k/v: [T, num_kv_heads*head_size] -> [T, num_heads*head_size].

        With `rotary`, q and k (row views whose heads are packed) are rotated in place first -- by the
        backend together with its cache write where it can (`impl.fuses_rotary`), else here. `kv_written`:
        the projection did both already (`qkv_rope`).
        """
        hook = get_split_hook()
        if hook is not None:  # a piecewise CUDA-graph capture ends its segment here
            assert not kv_written, "qkv_rope is never offered under a piecewise capture"
            return hook(self, q, k, v, rotary)
        return self.attend(q, k, v, rotary, q.new_empty(q.shape), kv_written)

    def qkv_rope(self, rotary: RotaryArgs) -> QKVRope | None:
        """This step's RoPE and new K / V cache write for the qkv projection's kernel to do instead (then
        `forward(..., kv_written=True)`), where the backend offers it (`impl.qkv_rope`): decode steps outside
        piecewise captures, with the cache bound."""
        if get_split_hook() is not None or self.kv_cache is None:
            return None
        return self.impl.qkv_rope(rotary, self.kv_cache, get_attn_metadata(self.layer_name))

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rotary: RotaryArgs | None,
        out: torch.Tensor,
        kv_written: bool = False,
    ) -> torch.Tensor:
        """`forward` into `out` ([T, num_heads*head_size]): the part a piecewise CUDA graph runs eagerly."""
        t = q.shape[0]
        if rotary is not None and not self.impl.fuses_rotary:
            from pagedllm.attention.ops.triton_rope_cache import apply_rotary_

            apply_rotary_(rotary, q, k, self.head_size)
            rotary = None
        q3 = q.view(t, self.num_heads, self.head_size)
        k3 = k.view(t, self.num_kv_heads, self.head_size)
        v3 = v.view(t, self.num_kv_heads, self.head_size)
        out3 = out.view(t, self.num_heads, self.head_size)
        md = get_attn_metadata(self.layer_name)
        twin = None
        if act_twin.wants_twin(self, out) == "q8" and self.impl.writes_q8_twin(md):
            twin = act_twin.q8_buffers(t, out.shape[1], out.device)
            self.impl.forward(q3, k3, v3, self.kv_cache, md, out3, rotary, kv_written, q8_twin=twin)  # type: ignore[call-arg]
            return act_twin.attach(out, twin)
        self.impl.forward(q3, k3, v3, self.kv_cache, md, out3, rotary, kv_written)
        return out
