"""Whether Triton is installed (CPU-only installs have none), for every module with Triton kernels: they
import `triton` only when `HAS_TRITON`, so importing them never fails and never compiles anything."""

from __future__ import annotations

import functools
import os
import re
from typing import Any

import torch

from pagedllm import envs

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU-only installs
    HAS_TRITON = False

HAS_GDC = False
if HAS_TRITON:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

        HAS_GDC = "launch_pdl" in CUDAOptions.__dataclass_fields__
    except ImportError:  # a Triton without grid dependency control: `pdl_args` gives {} and PDL stays False
        pass


def interpreted() -> bool:
    """Whether Triton kernels run under its interpreter (TRITON_INTERPRET=1: CPU tensors, the tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def require_triton() -> None:
    """Raised by the kernel launchers when Triton is missing (callers check `HAS_TRITON` first)."""
    if not HAS_TRITON:
        raise RuntimeError("Triton is not installed: the Triton kernels are unavailable")


_COUNTERS: dict[tuple[str, torch.device], torch.Tensor] = {}


def split_counters(device: torch.device, n: int, owner: str = "gemv") -> torch.Tensor:
    """Zeroed int32 counters for a split kernel's hand-off to its last program (split-K GEMVs, the split-row
    argmax), one buffer per `owner` and device, shared by that owner's launches (each leaves them at zero;
    launches of one owner run on one stream). Allocated on the first, eager, call of a shape, before any
    graph capture."""
    cnt = _COUNTERS.get((owner, device))
    if cnt is None or cnt.numel() < n:
        cnt = torch.zeros(max(n, 1 << 14), dtype=torch.int32, device=device)
        _COUNTERS[(owner, device)] = cnt
    return cnt


def row_warps(block: int) -> int:
    """Warps of a one-program-per-row kernel over `block` columns (norms, the tp=2 all-reduce + norm kernels, the
    per-token quantizer, the SiLU-mul writing an FP8 twin)."""
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (the grid-size heuristics of the split kernels)."""
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _num_sms(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


# Programmatic dependent launch (PDL, sm_90+). A kernel launched with it is scheduled as its predecessor in the
# stream finishes (once every program of the predecessor has exited, or called `gdc_launch_dependents`) instead of
# after the predecessor's completion has been processed, and waits for that completion and its memory inside the
# kernel (`gdc_wait`), first thing, before it reads or writes anything (but weights, which no kernel of a
# step writes: the GGUF GEMV's first step, the norms' weight vectors). "Early" kernels also announce their
# successor at their start: its programs are placed on the SMs and wait there, starting the moment this kernel
# completes. Each kernel boundary of a CUDA-graph decode step then costs less.
#
# Where: only in single-token 16-bit decode steps with the row GEMVs on (`one_row_step`), where every kernel
# boundary is between kernels of ours (the LM head too is a row GEMV there, vocab_embedding.compute_logits).
# In steps of more rows cuBLAS GEMMs (and at tp=2 the pulled all-reduce) sit between our kernels, and there PDL
# changed tokens: tp=2, 12 rows, 3 of 3 checks against PDL off, with and without early kernels, while PDL off
# against itself stayed equal and one-row steps always did (benchmarks/pdl_check.py; NOTES.md, session 38; the
# mechanism was not found: a library kernel that touches memory before it waits would explain it). Which
# kernels are early: PAGEDLLM_PDL_EARLY; the GEMVs stay late (early ones made tp=1 W3 4.29 against 4.18 ms).
# Measured on two H200s, W3 at tp=1 4.199 ms, tp=2 2.533 (without PDL 4.24-4.28 and 2.71-2.78).

KERNELS = ("norm", "silu", "rope", "attn", "gemv", "push", "recv", "pull", "w8a8", "qkv_rope")
"""The names launchers pass to `pdl_args` (`push`: the row GEMV that sends its partial sum to the tp=2 peer;
`recv` / `pull`: the tp=2 reductions that add the peer's partial sum; `w8a8`: the FP8 / INT8 decode GEMV;
`qkv_rope`: the GGUF qkv GEMV with RoPE and the cache write in its epilogue, `attention/qkv_rope.py`)."""


def pdl_args(x: torch.Tensor, kernel: str, rows: int | None = None) -> dict[str, Any]:
    """Launch keywords for `kernel` (one of `KERNELS`; its programs begin with `pdl_enter(PDL)`) on activations
    `x` of `rows` tokens (default `x.shape[0]`): in a `one_row_step` on a CUDA device of compute capability 9 or
    newer with a Triton that has grid dependency control, `{"PDL": mode, "launch_pdl": True}` with mode 2 (early)
    for the kernels named by `PAGEDLLM_PDL_EARLY`, else 1; `{}` (PDL=0, an ordinary launch) elsewhere or with
    `PAGEDLLM_PDL=0`. Two switches for finding why PDL changed tokens in batched tp=2 steps (session 38):
    `PAGEDLLM_PDL_ROWS=N` also launches steps of up to N rows with PDL (waiting, never early), and
    `PAGEDLLM_PDL_OFF` names kernels that never launch with it."""
    if x.device.type != "cuda":
        return {}
    n = x.shape[0] if rows is None else rows
    one = one_row_step(x, n)
    max_rows, off = _pdl_switches()
    if (not one and n > max_rows) or kernel in off:
        return {}
    return _pdl_kwargs(x.device.index if x.device.index is not None else torch.cuda.current_device(), kernel, one)


def one_row_step(x: torch.Tensor, rows: int) -> bool:
    """A launch of a single-token 16-bit decode step with the row GEMVs on: every kernel boundary is then one
    between PDL kernels of ours (see above)."""
    return rows == 1 and x.dtype in (torch.bfloat16, torch.float16) and row_gemv_on()


@functools.cache
def row_gemv_on() -> bool:
    """`PAGEDLLM_ROW_GEMV`, read once: batch-1 decode linears through `triton_gemv.row_gemv` (which asks too)."""
    return bool(envs.PAGEDLLM_ROW_GEMV)


def _kernel_names(value: str, variable: str, extra: frozenset[str] = frozenset()) -> frozenset[str]:
    """The kernel names of a `PAGEDLLM_PDL_*` list (comma- or +-separated); an unknown one is an error naming
    the variable, not a silently ordinary launch."""
    names = frozenset(n.strip() for n in re.split(r"[,+]", value.lower()) if n.strip())
    unknown = names - set(KERNELS) - extra
    if unknown:
        raise ValueError(f"{variable} names unknown kernels {sorted(unknown)}; known: {', '.join(KERNELS)}")
    return names


@functools.cache
def _pdl_switches() -> tuple[int, frozenset[str]]:
    """(PAGEDLLM_PDL_ROWS, PAGEDLLM_PDL_OFF's names), read once (every eager launch asks)."""
    return envs.PAGEDLLM_PDL_ROWS, _kernel_names(envs.PAGEDLLM_PDL_OFF, "PAGEDLLM_PDL_OFF")


@functools.cache
def _pdl_kwargs(index: int, kernel: str, may_be_early: bool) -> dict[str, Any]:
    """(One dict per device, kernel and case, unpacked by every launch: callers never mutate it.)"""
    nvidia = torch.version.hip is None  # (ROCm reports capabilities 9.x too)
    supported = HAS_GDC and nvidia and torch.cuda.get_device_capability(index)[0] >= 9
    early = envs.PAGEDLLM_PDL_EARLY if may_be_early else ""
    mode = pdl_mode_of(envs.PAGEDLLM_PDL, supported, kernel, early)
    return {"PDL": mode, "launch_pdl": True} if mode else {}


def pdl_mode_of(setting: str, supported: bool, kernel: str = "", early: str = "") -> int:
    """The PDL constexpr of `kernel` for a `PAGEDLLM_PDL` value and a list of early kernels (names from `KERNELS`
    separated by commas or `+`, or `all`) on a device that supports PDL or not."""
    setting = setting.strip().lower()
    names = _kernel_names(early, "PAGEDLLM_PDL_EARLY", frozenset({"all"}))
    if kernel and kernel not in KERNELS:
        raise ValueError(f"unknown PDL kernel name {kernel!r}")
    if setting not in ("0", "false", "off", "1", "true", "on"):
        raise ValueError(f"PAGEDLLM_PDL must be 0 or 1, not {setting!r}")
    if not supported or setting in ("0", "false", "off"):
        return 0
    return 2 if kernel in names or "all" in names else 1


if HAS_TRITON:
    from triton.language.extra import libdevice

    # Under the interpreter (CPU tests) a plain product is already rounded; libdevice's mul_rn has no
    # interpreter version.
    _INTERPRETED = tl.constexpr(interpreted())

    @triton.jit
    def mul_rn(a, b):
        """a * b rounded to float32 on its own (`mul.rn`, which is never contracted into an FMA): for arithmetic
        that must round each product as its reference does. With fusion on, a product feeding an add or a
        subtraction became an FMA on sm_90 even across a cast to 16 bits (LLVM then multiplies in half
        precision): the q8 quantizer's exact halves (session 42) and RoPE's `x1 * cos - x2 * sin` (session 43)."""
        a, b = tl.broadcast(a, b)
        if _INTERPRETED:
            return a * b
        else:
            return libdevice.mul_rn(a, b)

    @triton.jit
    def product_in(x, c, dt: tl.constexpr):
        """x * c rounded to `dt` (as float32), as a reference multiplying in the activation dtype does (RoPE)."""
        return mul_rn(x, c).to(dt).to(tl.float32)

    @triton.jit
    def silu_mul(g, u, dt: tl.constexpr):
        """silu(g) * u for float32 g and u that hold `dt` values, rounded as the PyTorch reference (`SiluAndMul`
        in `dt`) rounds it: the SiLU to dt, then the product. (The SiLU-mul kernel's.)"""
        act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        return (act * u).to(dt)

    @triton.jit
    def pdl_enter(PDL: tl.constexpr):
        """A PDL kernel's first step (no-op for PDL=0): an early kernel's (2) successor may launch from now on;
        then it waits for its predecessor's completion. Every program runs it before any early return: a kernel
        whose programs skipped the wait could complete before its predecessor."""
        pdl_trigger(PDL)
        pdl_wait(PDL)

    @triton.jit
    def pdl_trigger(PDL: tl.constexpr):
        """`pdl_enter`'s first half: an early kernel's (2) successor may launch from now on."""
        if PDL == 2:
            gdc_launch_dependents()

    @triton.jit
    def pdl_wait(PDL: tl.constexpr):
        """`pdl_enter`'s second half: the wait for the predecessor's completion (and its memory)."""
        if PDL:
            gdc_wait()
