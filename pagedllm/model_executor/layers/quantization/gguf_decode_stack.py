"""A Llama model's decoder layers in one C call for CPU decode steps with GGUF-packed weights.

At one token per request a step's arithmetic is a few milliseconds, while driving 30 layers of ~12 kernels
each from Python costs about as much again. `pagedllm/csrc/decode_stack.c` runs the same kernels in the
same order as the Python layers (so the result is bit-identical) with the glue in C. `DecodeStack.run` is
the whole interface: `LlamaModel.forward` calls it and falls back to its layers when it returns None
(prefill or mixed steps, layers it does not take, weights or caches changed since they were read).

Taken: plain Llama layers (`LlamaDecoderLayer` / `LlamaAttention` / `LlamaMLP` exactly, so Qwen2's biases,
Qwen3's q/k norm and the other subclasses keep their Python path), float32 activations, every linear
GGUF-packed without bias, full attention on a contiguous float32, bfloat16 or FP8 cache (float32 [1] scales)
through the C kernels, no forward hooks (LoRA adds its deltas through hooks), no tensor or pipeline parallelism,
not batch-invariant mode. `PAGEDLLM_CPU_DECODE_STACK=0` turns it off.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from pagedllm import csrc, envs
from pagedllm.forward_context import get_attn_metadata
from pagedllm.model_executor.layers import batch_invariant, cpu_ops
from pagedllm.model_executor.layers.quantization.gguf import GGUFLinearMethod
from pagedllm.model_executor.layers.quantization.gguf_blocks import MAX_PARTS, GGUFWeight

_LINEARS = ("qkv", "o", "gate_up", "down")  # GLayer's fields, in the layer's order
_CACHE_FP8 = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}  # GDims.cache_fp8


class GLinear(ctypes.Structure):
    _fields_ = [
        ("n_parts", ctypes.c_int32),
        ("type", ctypes.c_int32 * MAX_PARTS),
        ("rows", ctypes.c_int64 * MAX_PARTS),
        ("w", ctypes.c_void_p * MAX_PARTS),
    ]


class GLayer(ctypes.Structure):
    _fields_ = [
        ("in_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("qkv", GLinear),
        ("o", GLinear),
        ("gate_up", GLinear),
        ("down", GLinear),
        ("k_cache", ctypes.c_void_p),
        ("v_cache", ctypes.c_void_p),
        ("k_scale", ctypes.c_void_p),  # an FP8 cache's scales (float32 [1], read by the C code at every step)
        ("v_scale", ctypes.c_void_p),
    ]


class GDims(ctypes.Structure):
    _fields_ = [
        *[(f, ctypes.c_int32) for f in ("hidden", "heads", "kv_heads", "head_size", "inter", "rot_dim", "block_size")],
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("cos_sin", ctypes.c_void_p),
        ("cache_bf16", ctypes.c_int32),
        ("cache_fp8", ctypes.c_int32),  # 1: float8_e4m3fn, 2: float8_e5m2, 0: neither
    ]


class GScratch(ctypes.Structure):
    _fields_ = [(f, ctypes.c_void_p) for f in ("x", "qkv", "attn", "gu", "act", "xq", "xd", "xs")]


def _lib() -> ctypes.CDLL | None:
    lib = csrc.load()
    if lib is None or not hasattr(lib, "gguf_decode_stack_f32"):
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    csrc.declare(
        lib,
        "gguf_decode_stack_f32",
        ctypes.c_int,
        [p, ctypes.c_int, p, i64, p, p, p, i64, p, p, p, p, p, ctypes.c_int],
    )
    csrc.declare(lib, "gguf_decode_stack_set_one_region", ctypes.c_int, [ctypes.c_int])
    lib.gguf_decode_stack_set_one_region(int(envs.PAGEDLLM_CPU_DECODE_ONE_REGION))
    return lib


def _packed_parts(linear: Any) -> list[GGUFWeight] | None:
    """The linear's packed CPU weights, or None if it is not a bias-free GGUF linear the stack can run."""
    method = getattr(linear, "quant_method", None)
    if not isinstance(method, GGUFLinearMethod) or getattr(linear, "bias", None) is not None:
        return None
    parts = method.parts
    if not 1 <= len(parts) <= MAX_PARTS:
        return None
    if not all(type(p) is GGUFWeight and p.data.device.type == "cpu" for p in parts):
        return None
    return parts


def _glinear(parts: list[GGUFWeight]) -> GLinear:
    g = GLinear()
    g.n_parts = len(parts)
    for i, p in enumerate(parts):
        g.type[i], g.rows[i], g.w[i] = p.qtype, p.rows, p.data.data_ptr()
    return g


class DecodeStack:
    """The decoder layers of one `LlamaModel` as a C call (see the module docstring)."""

    def __init__(self, model: Any, layers: list[Any], lib: ctypes.CDLL) -> None:
        self.layers = layers
        self.lib = lib
        a0 = layers[0].self_attn
        self.attn_names = [layer.self_attn.attn.layer_name for layer in layers]
        self.dims = GDims(
            hidden=model.config.hidden_size,
            heads=a0.num_heads,
            kv_heads=a0.num_kv_heads,
            head_size=a0.head_dim,
            inter=layers[0].mlp.down_proj.input_size_per_partition,
            rot_dim=a0.rotary_emb.rotary_dim,
            block_size=0,
            eps=layers[0].input_layernorm.variance_epsilon,
            scale=a0.attn.impl.scale,
            cos_sin=a0.rotary_emb.cos_sin_cache.data_ptr(),
        )
        self._table: Any = None
        self._held: list[Any] = []  # what the table points into, checked for identity each step
        self._scratch: tuple[int, GScratch, list[torch.Tensor]] | None = None

    @classmethod
    def build(cls, model: Any) -> DecodeStack | None:
        """A stack for `model` (a `LlamaModel`) if every layer is one it runs, else None."""
        from pagedllm.model_executor.models.llama import LlamaDecoderLayer, LlamaMLP
        from pagedllm.model_executor.models.llama_attention import LlamaAttention

        if not envs.PAGEDLLM_CPU_DECODE_STACK or batch_invariant.enabled():
            return None
        layers: list[Any] = list(model.layers)
        if not layers or len(getattr(model, "stage_layers", [])) != len(layers):
            return None  # pipeline stages keep the Python path
        for layer in layers:
            attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            if type(layer) is not LlamaDecoderLayer or type(attn) is not LlamaAttention or type(mlp) is not LlamaMLP:
                return None
            rope = attn.rotary_emb
            if (
                attn.qk_norm
                or attn.attn.sliding_window is not None
                or attn.attn.impl.logits_soft_cap is not None
                or getattr(attn.qkv_proj, "tp_size", 1) != 1
                or rope.cos_sin_cache.dtype != torch.float32
                or not rope.cos_sin_cache.is_contiguous()
                or layer.input_layernorm.weight.dtype != torch.float32
                or any(_packed_parts(m) is None for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj))
            ):
                return None
        lib = _lib()
        return cls(model, layers, lib) if lib is not None else None

    def _current(self) -> list[Any]:
        """Everything the pointer table was built from (weights, norms, caches), in a fixed order."""
        held: list[Any] = []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            held += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight, attn.attn.kv_cache]
            held += attn.attn.impl.kv_scales or (None, None)  # (an FP8 cache's scales, pointed at)
            for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                held.append(m.quant_method)
                held += [p.data for p in getattr(m.quant_method, "parts", ())]  # the bytes the table points at
            held += [m._forward_hooks or None for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        held.append(self.layers[0].self_attn.rotary_emb.cos_sin_cache)
        return held

    def _build_table(self, held: list[Any]) -> bool:
        table = (GLayer * len(self.layers))()
        for i, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            kv = attn.attn.kv_cache
            scales = attn.attn.impl.kv_scales if kv is not None and kv.dtype in _CACHE_FP8 else None
            if scales is not None and not all(
                t.dtype == torch.float32 and t.device.type == "cpu" and t.numel() == 1 for t in scales
            ):
                return False
            if (
                kv is None
                or (kv.dtype not in (torch.float32, torch.bfloat16) and scales is None)
                or kv.device.type != "cpu"
                or not kv[0].is_contiguous()
                or not kv[1].is_contiguous()
                or layer.post_attention_layernorm.weight.dtype != torch.float32
                or not layer.input_layernorm.weight.is_contiguous()
                or not layer.post_attention_layernorm.weight.is_contiguous()
                or any(m._forward_hooks for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj))
            ):
                return False
            g = table[i]
            g.in_norm = layer.input_layernorm.weight.data_ptr()
            g.post_norm = layer.post_attention_layernorm.weight.data_ptr()
            for field, m in zip(_LINEARS, (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)):
                parts = _packed_parts(m)
                if parts is None:
                    return False
                setattr(g, field, _glinear(parts))
            g.k_cache, g.v_cache = kv[0].data_ptr(), kv[1].data_ptr()
            self.dims.block_size = kv.shape[2]
            self.dims.cache_bf16 = int(kv.dtype == torch.bfloat16)
            self.dims.cache_fp8 = _CACHE_FP8.get(kv.dtype, 0)
            if scales is not None:
                g.k_scale, g.v_scale = scales[0].data_ptr(), scales[1].data_ptr()
        self.dims.cos_sin = self.layers[0].self_attn.rotary_emb.cos_sin_cache.data_ptr()
        self._table, self._held = table, held
        return True

    def _scratch_for(self, t: int) -> GScratch:
        if self._scratch is None or self._scratch[0] < t:
            d = self.dims
            q, kv = d.heads * d.head_size, d.kv_heads * d.head_size
            k_max = max(d.hidden, q, d.inter)
            bufs = [torch.empty(t, n) for n in (d.hidden, q + 2 * kv, q, 2 * d.inter, d.inter)]
            bufs += [torch.empty(t, k_max, dtype=torch.int16), torch.empty(t, k_max // 32), torch.empty(t, k_max // 32)]
            self._scratch = (t, GScratch(*[b.data_ptr() for b in bufs]), bufs)
        return self._scratch[1]

    def run(self, positions: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(MLP output of the last layer, residual) for a decode-only step, or None (the caller runs its
        layers). `hidden` [T, H] are the step's embeddings (overwritten)."""
        if hidden.dtype != torch.float32 or hidden.device.type != "cpu" or not hidden.is_contiguous():
            return None
        t = hidden.shape[0]
        md = get_attn_metadata(self.attn_names[0])
        idx = getattr(md, "decode_token_idx", None)
        if idx is None or md.prefills or md.num_actual_tokens != t or int(idx.numel()) != t:
            return None
        if any(get_attn_metadata(n) is not md for n in self.attn_names):
            return None  # several KV-cache groups
        held = self._current()
        if self._table is None or len(held) != len(self._held) or any(a is not b for a, b in zip(held, self._held)):
            if not self._build_table(held):
                return None
        pos = positions.reshape(-1)
        if pos.dtype != torch.int64 or not pos.is_contiguous():
            pos = pos.to(torch.int64).contiguous()
        lo, hi = torch.aminmax(pos)
        if int(lo) < 0 or int(hi) >= self.layers[0].self_attn.rotary_emb.cos_sin_cache.shape[0]:
            raise IndexError("rotary embedding: position out of range")
        slots = md.slot_mapping[:t].to(torch.int64)
        bt = md.decode_block_table
        bt = bt if bt.dtype == torch.int32 and bt.stride(1) == 1 else bt.to(torch.int32).contiguous()
        seq = md.decode_seq_lens.to(torch.int32).contiguous()
        idx = idx.to(torch.int64).contiguous()
        residual = torch.empty_like(hidden)
        rc = self.lib.gguf_decode_stack_f32(
            ctypes.addressof(self._table), len(self.layers), ctypes.addressof(self.dims), t,
            pos.data_ptr(), slots.data_ptr(), bt.data_ptr(), bt.stride(0), seq.data_ptr(), idx.data_ptr(),
            hidden.data_ptr(), residual.data_ptr(), ctypes.addressof(self._scratch_for(t)), torch.get_num_threads(),
        )  # fmt: skip
        if rc != 0:
            raise ValueError("gguf decode stack: a kernel refused its shape")
        return hidden, residual


def maybe_attach(model: Any) -> None:
    """Gives a `LlamaModel` loaded with packed GGUF weights on the CPU its decode stack, where it applies."""
    if cpu_ops._load() is None:
        return
    stack = DecodeStack.build(model)
    if stack is not None:
        model.decode_stack = stack
