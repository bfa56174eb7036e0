"""Fused CPU layer kernels (`pagedllm/csrc/layers.c`, `activation.c`): residual add + RMSNorm, rotary
embedding, SiLU-and-mul, each one C pass instead of 5-8 PyTorch ops. The layers call `usable(x)` first
and keep their PyTorch code (the reference) for everything else: other devices and dtypes, layouts the
kernels do not take, or no C compiler.
"""

from __future__ import annotations

import ctypes

import torch

from pagedllm import csrc

_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}
_i64, _f32, _p, _int = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int
_lib: ctypes.CDLL | None = None
_state = {"tried": False}


def _load() -> ctypes.CDLL | None:
    global _lib
    if not _state["tried"]:
        lib = csrc.load()
        if lib is not None:
            for sfx in _DTYPES.values():
                csrc.declare(lib, f"rms_norm_{sfx}", None, [_p, _i64, _p, _i64, _p, _p, _i64, _i64, _i64, _f32, _int])
                csrc.declare(
                    lib, f"rotary_{sfx}", None, [_p, _p, _i64, _int, _p, _i64, _int, _p, _int, _int, _i64, _int]
                )
                csrc.declare(lib, f"silu_and_mul_{sfx}", None, [_p, _i64, _p, _i64, _i64, _i64, _int])
        _lib = lib
        _state["tried"] = True
    return _lib


def usable(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in _DTYPES and not x.requires_grad and _load() is not None


def _rows(x: torch.Tensor) -> torch.Tensor | None:
    """x as [rows, cols] with contiguous columns and one row stride, or None."""
    if x.dim() == 1:
        x = x.unsqueeze(0)
    if x.dim() > 2:
        try:
            x = x.view(-1, x.shape[-1])
        except RuntimeError:
            return None
    return x if x.stride(1) == 1 else None


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
    """Like RMSNorm.forward; with `residual`, it is updated in place to x + residual and returned second.
    None when the layout is not one the kernel takes."""
    x2 = _rows(x)
    r2 = _rows(residual) if residual is not None else None
    if (
        x2 is None
        or (residual is not None and (r2 is None or residual.dtype != x.dtype or r2.shape != x2.shape))
        or weight.dtype != x.dtype
        or not weight.is_contiguous()
    ):
        return None
    out = torch.empty(x.shape, dtype=x.dtype)
    rows, cols = x2.shape
    getattr(_lib, f"rms_norm_{_DTYPES[x.dtype]}")(
        x2.data_ptr(),
        x2.stride(0),
        r2.data_ptr() if r2 is not None else None,
        r2.stride(0) if r2 is not None else 0,
        weight.data_ptr(),
        out.data_ptr(),
        cols,
        rows,
        cols,
        eps,
        torch.get_num_threads(),
    )
    return out if residual is None else (out, residual)


def rotary_(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor, head_size: int, rotary_dim: int
) -> bool:
    """Neox rotary embedding in place on q [T, Hq*D] and k [T, Hk*D] (row views allowed). False (nothing
    done) when the layout is not one the kernel takes."""
    t = positions.numel()
    q2, k2 = _rows(q), _rows(k)
    if (
        q2 is None
        or k2 is None
        or q.dtype != k.dtype
        or q2.shape[0] != t
        or k2.shape[0] != t
        or cos_sin.dtype != torch.float32
        or not cos_sin.is_contiguous()
        or cos_sin.device.type != "cpu"
        or q2.shape[1] % head_size
        or k2.shape[1] % head_size
    ):
        return False
    pos = positions.reshape(-1)
    if pos.dtype != torch.int64 or not pos.is_contiguous():
        pos = pos.to(torch.int64).contiguous()
    if t:
        lo, hi = torch.aminmax(pos)
        if int(lo) < 0 or int(hi) >= cos_sin.shape[0]:
            raise IndexError(f"rotary embedding: position out of range [0, {cos_sin.shape[0]})")
    getattr(_lib, f"rotary_{_DTYPES[q.dtype]}")(
        pos.data_ptr(),
        q2.data_ptr(),
        q2.stride(0),
        q2.shape[1] // head_size,
        k2.data_ptr(),
        k2.stride(0),
        k2.shape[1] // head_size,
        cos_sin.data_ptr(),
        head_size,
        rotary_dim,
        t,
        torch.get_num_threads(),
    )
    return True


def silu_and_mul(x: torch.Tensor) -> torch.Tensor | None:
    """silu(x[..., :d]) * x[..., d:], or None when the layout is not one the kernel takes."""
    x2 = _rows(x)
    if x2 is None:
        return None
    rows, two_d = x2.shape
    d = two_d // 2
    out = torch.empty(*x.shape[:-1], d, dtype=x.dtype)
    getattr(_lib, f"silu_and_mul_{_DTYPES[x.dtype]}")(
        x2.data_ptr(), x2.stride(0), out.data_ptr(), d, rows, d, torch.get_num_threads()
    )
    return out
