"""The copy-engine prefill path (`distributed/ce_allreduce.py`) on the CPU: chunk planning, which matmuls it
takes, that it stays off without CUDA or where it does not apply, the routing of a partial sum's pieces in
`FusedAllReduceNorm.matmul`, the norm kernel's arithmetic under the Triton interpreter (bit-equal to the fused
add + RMSNorm of the sum) and its compilation for sm_90. The two-GPU behaviour is tests/gpu/test_ce_allreduce_gpu.py."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from pagedllm.distributed import ce_allreduce as ce
from pagedllm.distributed.fused_allreduce_norm import FusedAllReduceNorm
from pagedllm.model_executor.layers import batch_invariant
from pagedllm.model_executor.layers.linear import UnquantizedLinearMethod
from tests.interpreted import run_interpreted

HIDDEN, K = 64, 32


def _layer(dtype: torch.dtype = torch.bfloat16, shape: tuple[int, int] = (HIDDEN, K), **extra: Any) -> nn.Module:
    layer = nn.Module()
    layer.quant_method = UnquantizedLinearMethod()  # type: ignore[assignment]
    layer.weight = nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)
    layer.bias = None  # type: ignore[assignment]
    for name, value in extra.items():
        setattr(layer, name, value)
    return layer


ADMIT = ce.Admission(torch.bfloat16, HIDDEN, min_rows=2048, capacity=16384, chunks=4)


@pytest.mark.parametrize(
    ("rows", "chunks", "step"),
    [(16384, 4, 4096), (16384, 1, 16384), (16384, 64, 4096), (16384, 2, 8192), (12000, 4, 6016), (3000, 4, 4096)],
)
def test_chunk_step(rows: int, chunks: int, step: int) -> None:
    assert ce.chunk_step(rows, chunks) == step
    assert step % ce.ROW_ALIGN == 0 and step >= ce.MIN_CHUNK_ROWS
    assert -(-rows // step) <= max(1, min(chunks, ce.MAX_CHUNKS))


@pytest.mark.parametrize(("start", "rows", "step"), [(0, 16384, 4096), (0, 3000, 1536), (4096, 4096, 1536), (5, 7, 4)])
def test_piece_bounds_cover_the_rows_and_cut_at_multiples(start: int, rows: int, step: int) -> None:
    bounds = ce.piece_bounds(start, rows, step)
    assert bounds[0][0] == start and bounds[-1][1] == start + rows
    assert all(b0[1] == b1[0] for b0, b1 in zip(bounds, bounds[1:], strict=False))
    assert all(a < b and a // step == (b - 1) // step for a, b in bounds)  # each inside one chunk


def test_admission_takes_prefill_sized_plain_matmuls() -> None:
    layer = _layer()
    x = torch.zeros(4096, K, dtype=torch.bfloat16)
    assert ADMIT.step_for(layer, x) == 4096
    assert ADMIT.step_for(layer, x.view(2, 2048, K)) == 4096  # rows counted over the leading dims
    assert ADMIT.step_for(layer, torch.zeros(2048, K, dtype=torch.bfloat16)) is None  # the fused kernel's
    assert ADMIT.step_for(layer, torch.zeros(16385, K, dtype=torch.bfloat16)) is None  # over the buffer
    assert ADMIT.step_for(layer, x.float()) is None


@pytest.mark.parametrize(
    "layer",
    [
        _layer(dtype=torch.float16),
        _layer(shape=(HIDDEN + 1, K)),
        _layer(bias=nn.Parameter(torch.zeros(HIDDEN))),
        _layer(packed_weight=torch.zeros(1)),
        _layer(row_gemv_lora=object()),
        _layer(quant_method=object()),
    ],
    ids=["dtype", "shape", "bias", "packed", "lora", "quantized"],
)
def test_admission_leaves_other_layers(layer: nn.Module) -> None:
    assert ADMIT.step_for(layer, torch.zeros(4096, K, dtype=torch.bfloat16)) is None


def test_admission_leaves_batch_invariant_gemms() -> None:
    batch_invariant.set_enabled(True)
    try:
        assert ADMIT.step_for(_layer(), torch.zeros(4096, K, dtype=torch.bfloat16)) is None
    finally:
        batch_invariant.set_enabled(False)


def test_matmul_declines_cpu_tensors() -> None:
    path = object.__new__(ce.CopyEnginePrefill)  # (a CUDA device and a peer are needed to construct one)
    assert path.matmul(_layer(), torch.zeros(4096, K, dtype=torch.bfloat16)) is None


def test_try_create_returns_early_where_it_does_not_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    """Config-only refusals, before anything collective or CUDA (every rank refuses alike)."""
    fused: Any = SimpleNamespace(world=2, max_rows=2048)
    assert ce.try_create(fused, None, torch.device("cpu"), capacity=2048) is None
    assert ce.try_create(SimpleNamespace(world=4, max_rows=2048), None, torch.device("cpu"), 16384) is None  # type: ignore[arg-type]
    monkeypatch.setenv("PAGEDLLM_TP_CE_PREFILL", "0")
    assert ce.try_create(fused, None, torch.device("cpu"), capacity=16384) is None


def test_env_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedllm import envs

    monkeypatch.delenv("PAGEDLLM_TP_CE_PREFILL", raising=False)
    monkeypatch.delenv("PAGEDLLM_TP_CE_CHUNKS", raising=False)
    assert envs.PAGEDLLM_TP_CE_PREFILL is True and envs.PAGEDLLM_TP_CE_CHUNKS == 4
    monkeypatch.setenv("PAGEDLLM_TP_CE_CHUNKS", "2")
    assert envs.PAGEDLLM_TP_CE_CHUNKS == 2


class _Path:
    """A stand-in `PartialPath`: takes matmuls of at least `min_rows` rows (and every later piece)."""

    def __init__(self, min_rows: int) -> None:
        self.min_rows, self.taken = min_rows, 0
        self.pending = False

    def matmul(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        if not self.pending and x.shape[0] < self.min_rows:
            return None
        self.pending, self.taken = True, self.taken + 1
        return x

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> Any:
        self.pending = False
        return x, residual


def test_pieces_of_a_partial_sum_go_to_the_path_that_took_the_first() -> None:
    small, big = _Path(10), _Path(1)
    router: Any = SimpleNamespace(paths=[small, big], _pending=None)
    x8, x4 = torch.zeros(8, K), torch.zeros(4, K)
    assert FusedAllReduceNorm.matmul(router, nn.Module(), x8) is x8  # `small` declines 8 rows: `big` takes them
    assert FusedAllReduceNorm.matmul(router, nn.Module(), x4) is x4  # the next piece: `big` again
    assert (small.taken, big.taken) == (0, 2) and router._pending is big
    FusedAllReduceNorm.__call__(router, x8, x8, x8[0], 1e-6)
    assert router._pending is None and not big.pending


@pytest.fixture(scope="module")
def interpreted() -> dict[str, bool]:
    pytest.importorskip("triton")
    out = run_interpreted(Path(__file__).with_name("ce_interpret_check.py"))
    result: dict[str, bool] = json.loads(out)
    return result


def test_norm_kernel_bit_equal_to_fused_add_rms_norm_of_the_sum(interpreted: dict[str, bool]) -> None:
    assert len(interpreted) == 24
    assert [k for k, ok in interpreted.items() if not ok] == []


def test_norm_kernel_compiles_for_sm90() -> None:
    """Compiled ahead of time for an H100/H200 (Triton's bundled ptxas, no GPU): the flag wait is a system-scope
    acquire load and the received rows are read in 16-byte vectors past L1."""
    triton = pytest.importorskip("triton")
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as e:
        pytest.skip(f"this Triton has no ahead-of-time API ({e})")
    sig = {n: "*bf16" for n in ("x_ptr", "recv_ptr", "res_ptr", "out_ptr", "res_out_ptr", "w_ptr")}
    sig |= {"flags_ptr": "*i32", "epoch": "i32", "n_rows": "i32", "n_cols": "i32", "step": "i32"}
    sig |= {"stride_x": "i32", "stride_r": "i32", "eps": "fp32", "RANK": "constexpr", "MOD": "constexpr"}
    sig |= {"BLOCK": "constexpr"}
    aligned = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 5, 6, 9, 11, 12)}
    src = ASTSource(
        fn=ce._recv_add_norm_kernel,
        signature=sig,
        constexprs={"RANK": 1, "MOD": ce.EPOCH_MOD, "BLOCK": 4096},
        attrs=aligned,
    )
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"]
    assert "ld.global.sys.acquire" in ptx or "atom.acquire.sys" in ptx or "atom.sys.acquire" in ptx
    assert "ld.global.cg.v4" in ptx
