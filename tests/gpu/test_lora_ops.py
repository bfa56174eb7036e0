"""Issue 21: the Triton segmented LoRA shrink/expand (`lora/ops.py`) and the on-device token grouping
(`TokenLoRAState.prepare`) against the PyTorch path (per slot: (x @ A^T) @ B^T added to the rows of its
tokens), with base-model tokens (-1) interleaved, empty slots, a single token and decode/prefill sizes;
float32 in IEEE float32 (1e-5 of the output's scale), bf16 within 2 bf16 ulps of the scale. Also: one CUDA
graph replays the grouping and the kernels for new per-token slots. Runs on the CPU under the Triton
interpreter too (TRITON_INTERPRET=1, float32 only)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.gpu.triton_env import DEVICE, INTERPRET, require_triton_device

pytestmark = pytest.mark.gpu

require_triton_device()

from pagedllm.lora.layers import TokenLoRAState  # noqa: E402
from pagedllm.lora.ops import lora_shrink_expand  # noqa: E402

DTYPES = [torch.float32] + ([] if INTERPRET else [torch.bfloat16])
REL = {torch.float32: 1e-5, torch.bfloat16: 2 * 2**-8}
# (tokens, slots, in, out, rank per slice x slices); the third and last split K (few token blocks)
SHAPES = [
    (1, 2, 64, 96, 16),
    (37, 4, 128, 80, 48),
    (3, 2, 1024, 32, 16),
    (300, 3, 256, 512, 32),
    (64, 4, 4096, 6144, 48),
]
if INTERPRET:
    SHAPES = SHAPES[:3]


def _grouped(slots: np.ndarray, num_slots: int, use_triton: bool) -> TokenLoRAState:
    st = TokenLoRAState(num_slots, 512, torch.device(DEVICE), use_triton)
    st.set_token_slots(slots.astype(np.int32))
    st.prepare(torch.nn.Identity(), (torch.zeros(len(slots)),))
    return st


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_shrink_expand_match_torch(shape: tuple, dtype: torch.dtype) -> None:
    t, nl, k, n, r = shape
    g = torch.Generator(device=DEVICE).manual_seed(t)
    x = torch.randn(t, k, device=DEVICE, generator=g).to(dtype)
    a = (torch.randn(nl, r, k, device=DEVICE, generator=g) * k**-0.5).to(dtype)
    b = (torch.randn(nl, n, r, device=DEVICE, generator=g) * r**-0.5).to(dtype)
    base = torch.randn(t, n, device=DEVICE, generator=g).to(dtype)
    rng = np.random.default_rng(t)
    slots = rng.integers(-1, nl - 1, size=t)  # slot nl-1 stays empty; -1: the base model
    ref = base.float().clone()
    for s in range(nl):
        idx = torch.from_numpy(np.nonzero(slots == s)[0]).to(DEVICE)
        ref[idx] += (x[idx].float() @ a[s].float().T) @ b[s].float().T
    st = _grouped(slots, nl, True)
    out = base.clone()
    assert st.sorted_idx is not None and st.seg_start is not None and st.seg_len is not None
    # The split-K shapes take their zeroed buffer from a wider shared one (as the layers do), the rest alloc.
    shared = torch.zeros(t + 5, r + 16, dtype=torch.float32, device=DEVICE) if k >= 1024 else None
    lora_shrink_expand(x, a, b, out, st.sorted_idx, st.seg_start, st.seg_len, shared)
    scale = float(ref.abs().max())
    err = float((out.float() - ref).abs().max())
    assert err <= REL[dtype] * scale, (err, scale)
    assert torch.equal(out[torch.from_numpy(slots < 0).to(DEVICE)], base[torch.from_numpy(slots < 0).to(DEVICE)])


@pytest.mark.skipif(INTERPRET, reason="CUDA graphs need a GPU")
def test_graph_replay_takes_new_slots() -> None:
    """A captured grouping + shrink/expand replays correctly when only the token-slot buffer changes."""
    t, nl, k, n, r = 24, 3, 128, 64, 16
    x = torch.randn(t, k, device="cuda")
    a = torch.randn(nl, r, k, device="cuda") * k**-0.5
    b = torch.randn(nl, n, r, device="cuda") * r**-0.5
    st = TokenLoRAState(nl, 64, torch.device("cuda"), True)
    st.set_token_slots(np.zeros(t, dtype=np.int32))
    out = torch.zeros(t, n, device="cuda")

    def body() -> None:
        out.zero_()
        st.prepare(torch.nn.Identity(), (x,))
        lora_shrink_expand(x, a, b, out, st.sorted_idx, st.seg_start, st.seg_len)  # type: ignore[arg-type]

    body()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    for seed in range(3):
        slots = np.random.default_rng(seed).integers(-1, nl, size=t).astype(np.int32)
        st.set_token_slots(slots)
        graph.replay()
        ref = torch.zeros(t, n, device="cuda")
        for s in range(nl):
            idx = torch.from_numpy(np.nonzero(slots == s)[0]).cuda()
            ref[idx] = (x[idx] @ a[s].T) @ b[s].T
        torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("slot", [-1, 0, 2])
@pytest.mark.parametrize("shape", [(96, 256, 48, None), (100, 200, 10, (4, 64, 2, 1))], ids=["even", "uneven"])
def test_row_gemv_computes_the_lora_shrink(shape: tuple, slot: int) -> None:
    """Batch-1 decode: the base layer's row GEMV also writes x @ A[slot]^T (the shrink, float32: one tile
    per program, partial sums added by the last of each row block) in the same launch, twice in a row (the
    counters reset themselves); for a base-model token (slot -1) it leaves the shrink buffer alone."""
    from pagedllm.model_executor.layers.triton_gemv import RowGemvLoRA, row_gemv

    n, k, r, config = shape
    dtype = torch.float32 if INTERPRET else torch.bfloat16
    g = torch.Generator(device=DEVICE).manual_seed(n + slot)
    x = torch.randn(1, k, device=DEVICE, generator=g).to(dtype)
    w = (torch.randn(n, k, device=DEVICE, generator=g) * k**-0.5).to(dtype)
    bias = torch.randn(n, device=DEVICE, generator=g).to(dtype)
    a = (torch.randn(3, r, k, device=DEVICE, generator=g) * k**-0.5).to(dtype)
    slot_t = torch.tensor([slot], dtype=torch.int32, device=DEVICE)
    lora = RowGemvLoRA.create(a, slot_t, n, config)
    lora.out.fill_(7.0)
    tol = 1e-5 if dtype == torch.float32 else 2 * 2**-8
    ref = x.float() @ w.float().T + bias.float()
    for _ in range(2):
        y = row_gemv(x, w, bias, config=config, lora=lora)
        assert lora.done
        torch.testing.assert_close(y.float(), ref, atol=tol * 4, rtol=tol)
        if slot < 0:
            assert bool((lora.out == 7.0).all())
        else:
            torch.testing.assert_close(lora.out, x.float() @ a[slot].float().T, atol=1e-4, rtol=1e-4)
        assert not bool(lora.count.any())  # reset for the next launch
