"""GGUF block-quantized weights kept packed, multiplied by the C kernels of `pagedllm/csrc/gguf_mm.c`.

A layer's weight is one or more `GGUFWeight` parts (the file's bytes, [rows, row_bytes] uint8) stacked by
output rows: a fused projection (qkv, gate_up) whose sub-weights share a type is one part, and mixed types
(a Q4_K_M file's Q6_K `attn_v` next to Q4_K q/k) stay separate parts writing into slices of the output.
Activations are quantized once per call to int16 per block of 32 (llama.cpp quantizes them per block to
int8; 16 bits keep the logits within ~1e-3 of the dequantized model's) and every part dots them with its
blocks; the output is in the activation's dtype (float32 logits for the LM head).
"""

from __future__ import annotations

import ctypes
import functools
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from pagedllm.attention.qkv_rope import QKVRope

from pagedllm import csrc
from pagedllm.model_executor.layers.linear import LinearBase, LinearMethodBase
from pagedllm.model_executor.layers.quantization.gguf_blocks import (  # noqa: F401  (re-exported)
    _BLOCK,
    MAX_PARTS,
    PACKED_TYPES,
    TILED,
    GGUFTritonWeight,
    GGUFWeight,
    row_bytes,
)

_i64, _p, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_ISA_NAMES = {0: "portable C", 1: "AVX2", 2: "AVX-512 VNNI"}


@functools.cache
def _lib() -> ctypes.CDLL | None:
    lib = csrc.load()
    if lib is None or not hasattr(lib, "gguf_mm"):
        return None
    for sfx in ("f32", "bf16"):
        csrc.declare(lib, f"gguf_quantize_act_{sfx}", None, [_p, _i64, _i64, _i64, _p, _p, _p, _int])
    csrc.declare(lib, "gguf_mm", _int, [_int, _p, _i64, _i64, _p, _p, _p, _i64, _p, _i64, _int, _int])
    csrc.declare(lib, "gguf_mm_parts", _int, [_int, _p, _p, _p, _i64, _p, _p, _p, _i64, _p, _i64, _int, _int])
    csrc.declare(lib, "gguf_dequantize", _int, [_int, _p, _i64, _i64, _p, _int])
    csrc.declare(lib, "gguf_set_isa", _int, [_int])
    csrc.declare(lib, "gguf_set_tile", _int, [_int])
    csrc.declare(lib, "gguf_isa", _int, [])
    csrc.declare(lib, "gguf_tile_pack", _i64, [_int, _p, _i64, _i64, _p])
    return lib


def kernels_available() -> bool:
    return _lib() is not None


def set_isa(level: int) -> int:
    """Forces the kernels' instruction set (0 portable C, 1 AVX2, 2 AVX-512 VNNI, -1 the best this CPU
    has); returns the level in use, which is never above what the CPU supports."""
    lib = _lib()
    if lib is None:
        raise RuntimeError("the GGUF CPU kernels are not available (no C compiler?)")
    return int(lib.gguf_set_isa(level))


def set_tile(on: bool) -> bool:
    """With AVX-512 VNNI, Q4_0 / Q4_1 / Q8_0 run the column-tile kernel (`csrc/gguf_tile.c`, the default) or,
    off, the older row kernels of `csrc/gguf_mm.c` (benchmarks and tests compare them). Returns the previous
    setting."""
    lib = _lib()
    if lib is None:
        raise RuntimeError("the GGUF CPU kernels are not available (no C compiler?)")
    return bool(lib.gguf_set_tile(int(on)))


def tile(w: GGUFWeight) -> GGUFWeight:
    """`w` re-laid for the AVX-512 VNNI column-tile kernel where that kernel runs (Q4_0 / Q4_1 / Q8_0): the
    same bits, but a tile's 16 rows come block by block in memory order with their quants already in lane
    order, so the kernel neither transposes nor reads 16 rows side by side (a decode step at 1.2x the
    file layout's speed, 16 rows at 1.2x; NOTES session 24). Anything else is returned as it is."""
    lib = _lib()
    if lib is None or w.qtype not in (2, 3, 8) or w.cols % 32 or lib.gguf_isa() != 2 or not lib.gguf_set_tile(-1):
        return w
    data = w.data.contiguous()
    size = int(lib.gguf_tile_pack(w.qtype, data.data_ptr(), w.rows, w.cols, None))
    out = torch.empty(size, dtype=torch.uint8)
    lib.gguf_tile_pack(w.qtype, data.data_ptr(), w.rows, w.cols, out.data_ptr())
    return GGUFWeight(w.qtype | TILED, out, w.rows, w.cols)


def isa_name() -> str:
    lib = _lib()
    return "none" if lib is None else _ISA_NAMES[int(lib.gguf_isa())]


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] float32/bfloat16 (K % 32 == 0) -> (int16 [M, K], scales [M, K/32], scale*sum [M, K/32])."""
    lib = _lib()
    assert lib is not None
    m, k = x.shape
    xq = torch.empty(m, k, dtype=torch.int16)
    xd = torch.empty(m, k // 32, dtype=torch.float32)
    xs = torch.empty_like(xd)
    fn = lib.gguf_quantize_act_bf16 if x.dtype == torch.bfloat16 else lib.gguf_quantize_act_f32
    fn(x.data_ptr(), x.stride(0), m, k, xq.data_ptr(), xd.data_ptr(), xs.data_ptr(), torch.get_num_threads())
    return xq, xd, xs


def gguf_matmul(
    x: torch.Tensor,
    parts: list[GGUFWeight],
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x [..., K] @ concat(parts).T (+ bias) -> [..., sum(rows)] in `out_dtype` (default x's dtype).
    Parts prepared for the GPU (`GGUFTritonWeight`) run the Triton kernels of `gguf_triton`."""
    if parts and isinstance(parts[0], GGUFTritonWeight):
        from pagedllm.model_executor.layers.quantization.gguf_triton import gguf_matmul_triton

        return gguf_matmul_triton(x, parts, bias, out_dtype)
    lib = _lib()
    assert lib is not None
    lead = x.shape[:-1]
    k = x.shape[-1]
    n = sum(p.rows for p in parts)
    out_dtype = out_dtype or x.dtype
    x2 = x.reshape(-1, k)
    if x2.dtype not in (torch.float32, torch.bfloat16):
        x2 = x2.float()
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    kernel_dtype = torch.bfloat16 if out_dtype == torch.bfloat16 else torch.float32
    out = torch.empty(m, n, dtype=kernel_dtype)
    if m:
        xq, xd, xs = quantize_activations(x2)
        nt = torch.get_num_threads()
        start = 0
        for g0 in range(0, len(parts), MAX_PARTS):  # one call per MAX_PARTS parts (one parallel region for their tiles)
            group = parts[g0 : g0 + MAX_PARTS]
            n_p = len(group)
            rc = lib.gguf_mm_parts(
                n_p, (_int * n_p)(*(p.qtype for p in group)), (_p * n_p)(*(p.data.data_ptr() for p in group)),
                (_i64 * n_p)(*(p.rows for p in group)), k, xq.data_ptr(), xd.data_ptr(), xs.data_ptr(), m,
                out.data_ptr() + start * out.element_size(), n, int(kernel_dtype == torch.bfloat16), nt,
            )  # fmt: skip
            if rc != 0:
                names = ", ".join(p.type_name for p in group)
                raise ValueError(f"gguf_mm: weights of types {names} with {k} columns are not supported")
            start += sum(p.rows for p in group)
    if bias is not None:
        out += bias.to(out.dtype)
    if out.dtype != out_dtype:
        out = out.to(out_dtype)
    return out.view(*lead, n)


def dequantize(w: GGUFWeight) -> torch.Tensor:
    """The weight as float32 [rows, cols] (the C kernels' own dequantization)."""
    lib = _lib()
    assert lib is not None
    out = torch.empty(w.rows, w.cols, dtype=torch.float32)
    if lib.gguf_dequantize(w.qtype, w.data.data_ptr(), w.rows, w.cols, out.data_ptr(), torch.get_num_threads()):
        raise ValueError(f"cannot dequantize {w.type_name} with {w.cols} columns")
    return out


class GGUFLinearMethod(LinearMethodBase):
    """Linear layer whose weight is GGUF blocks kept packed (installed by the GGUF loader after the layer
    was built: the dense placeholder weight is dropped): the C kernels on the CPU, the Triton kernels for
    parts prepared for the GPU (`GGUFTritonWeight`)."""

    def __init__(self, parts: list[GGUFWeight]) -> None:
        self.parts = parts

    def create_weights(self, layer: nn.Module, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("GGUF weights are installed by the loader")

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return gguf_matmul(x, self.parts, bias)

    def apply_rope(self, layer: nn.Module, x: torch.Tensor, rope: QKVRope) -> torch.Tensor | None:
        """A qkv projection with RoPE and the K / V cache write in the int8 GEMV's epilogue
        (`QKVParallelLinear.forward_rope`), or None where the launch cannot take it (`gguf_triton.rope_fits`)."""
        if not (self.parts and isinstance(self.parts[0], GGUFTritonWeight)):
            return None
        from pagedllm.model_executor.layers.quantization.gguf_triton import gguf_matmul_triton, rope_fits

        return gguf_matmul_triton(x, self.parts, rope=rope) if rope_fits(x, self.parts, rope) else None

    @property
    def twin_kind(self) -> str | None:
        """ "q8" where the GPU's int8 GEMV multiplies a part (`gguf_triton.Q8A_TYPES`): its input's producer may
        write the int8 quantization with it (act_twin.py)."""
        from pagedllm.model_executor.layers.quantization.gguf_triton import Q8A_TYPES

        q8 = any(isinstance(p, GGUFTritonWeight) and p.qtype in Q8A_TYPES for p in self.parts)
        return "q8" if q8 and self.parts[0].cols % 32 == 0 else None

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


def install(layer: LinearBase, parts: list[GGUFWeight]) -> None:
    """Makes `layer` multiply with `parts`, dropping its dense weight parameter."""
    layer._parameters.pop("weight", None)
    layer.quant_method = GGUFLinearMethod(parts)
