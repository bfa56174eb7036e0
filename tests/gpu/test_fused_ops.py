"""Fused Triton kernels (`triton_ops`) against the PyTorch reference layers they replace (GPU;
`pytest -m gpu tests/gpu/test_fused_ops.py`).

The references are the modules' own CPU-path code (`RMSNorm._norm`, `SiluAndMul`, `RotaryEmbedding`)
run on the same device and dtype, so the comparison checks rounding step by step, not just closeness to
a float64 ideal. Runs on CPU under the Triton interpreter too (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.gpu.triton_env import DEVICE, INTERPRET, require_triton_device  # noqa: E402

pytestmark = pytest.mark.gpu

require_triton_device()

from pagedllm.attention.ops import triton_rope_cache  # noqa: E402
from pagedllm.model_executor.layers import triton_ops  # noqa: E402
from pagedllm.model_executor.layers.layernorm import RMSNorm  # noqa: E402
from pagedllm.model_executor.layers.rotary_embedding import get_rope  # noqa: E402

# The interpreter (Triton 3.6) truncates float32 -> bfloat16 instead of rounding: bf16 only on the GPU.
DTYPES = [torch.float32, torch.float16] + ([] if INTERPRET else [torch.bfloat16])
# Elementwise bounds: a couple of ulps of the dtype (exp/rsqrt implementations and fp32 sum order
# differ from PyTorch's), relative to the tensor's magnitude.
ATOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
RTOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    dt = ref.dtype
    assert out.dtype == dt and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=ATOL[dt], rtol=RTOL[dt])


def _norm_module(hidden: int, dtype: torch.dtype, g: torch.Generator) -> RMSNorm:
    norm = RMSNorm(hidden, eps=1e-6)
    norm.weight.data = (1.0 + 0.5 * torch.randn(hidden, generator=g)).to(DEVICE, dtype)
    return norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 1024, 4096])
@pytest.mark.parametrize("n_tokens", [1, 7, 256])
def test_rms_norm(dtype: torch.dtype, hidden: int, n_tokens: int) -> None:
    g = torch.Generator().manual_seed(hidden * 1000 + n_tokens)
    norm = _norm_module(hidden, dtype, g)
    x = (3.0 * torch.randn(n_tokens, hidden, generator=g)).to(DEVICE, dtype)
    res = torch.randn(n_tokens, hidden, generator=g).to(DEVICE, dtype)
    _close(triton_ops.rms_norm(x, norm.weight, norm.variance_epsilon), norm._norm(x))
    x_before, res_before = x.clone(), res.clone()
    out, new_res = triton_ops.fused_add_rms_norm(x, res, norm.weight, norm.variance_epsilon)
    ref_res = x + res
    assert torch.equal(new_res, ref_res)  # the residual add is one rounding in both
    _close(out, norm._norm(ref_res))
    assert torch.equal(x, x_before) and torch.equal(res, res_before)  # inputs untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split", [2, 8])
@pytest.mark.parametrize(("n_tokens", "hidden"), [(1, 4096), (8, 576), (9, 1024)])
def test_rms_norm_split_rows_are_the_same(
    dtype: torch.dtype, split: int, n_tokens: int, hidden: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`PAGEDLLM_NORM_COL_SPLIT`: decode rows normalized by several programs each give the one-program results bit
    for bit (the statistics summed in the same order), q8 twin included; 9 rows stay one program a row."""
    from pagedllm.model_executor.layers.quantization import act_twin

    g = torch.Generator().manual_seed(hidden + n_tokens + split)
    norm = _norm_module(hidden, dtype, g)
    x = (3.0 * torch.randn(n_tokens, hidden, generator=g)).to(DEVICE, dtype)
    res = torch.randn(n_tokens, hidden, generator=g).to(DEVICE, dtype)
    twin = "q8" if dtype != torch.float32 else None
    runs = []
    for s in (1, split):
        monkeypatch.setenv("PAGEDLLM_NORM_COL_SPLIT", str(s))
        out, new_res = triton_ops.fused_add_rms_norm(x, res, norm.weight, norm.variance_epsilon, twin)
        runs.append((triton_ops.rms_norm(x, norm.weight, norm.variance_epsilon, twin), out, new_res))
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)
        ta, tb = act_twin.twin_of(a), act_twin.twin_of(b)
        assert (ta is None) == (tb is None)
        assert all(torch.equal(u, v) for u, v in zip(ta or (), tb or (), strict=True))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_strided_rows(dtype: torch.dtype) -> None:
    """Rows that are views into a wider tensor (the per-head q of a fused qkv)."""
    g = torch.Generator().manual_seed(5)
    norm = _norm_module(128, dtype, g)
    qkv = torch.randn(9, 16 * 128 + 2 * 8 * 128, generator=g).to(DEVICE, dtype)
    q = qkv[:, : 16 * 128].reshape(9, 16, 128)
    _close(triton_ops.rms_norm(q, norm.weight, 1e-6), norm._norm(q))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [1536, 3072, 14336])
@pytest.mark.parametrize("n_tokens", [1, 33])
def test_silu_and_mul(dtype: torch.dtype, d: int, n_tokens: int) -> None:
    g = torch.Generator().manual_seed(d + n_tokens)
    x = (2.0 * torch.randn(n_tokens, 2 * d, generator=g)).to(DEVICE, dtype)
    ref = F.silu(x[:, :d]) * x[:, d:]
    _close(triton_ops.silu_and_mul(x), ref)


@pytest.mark.skipif(INTERPRET, reason="bit equality needs the GPU's rounding")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", [(14336, 4096), (7168, 4096), (1536, 576), (37, 200)])
def test_row_gemv_glu_equals_gemv_then_silu_and_mul(dtype: torch.dtype, n: int, k: int) -> None:
    """The batch-1 gate/up GEMV with SiLU-mul in its epilogue (`row_gemv(glu=True)`, LlamaMLP's decode path) is
    bit-identical to the plain row GEMV followed by `triton_ops.silu_and_mul`."""
    from pagedllm.model_executor.layers import triton_gemv

    g = torch.Generator().manual_seed(n + k)
    w = (torch.randn(2 * n, k, generator=g) / k**0.5).to(DEVICE, dtype)
    for _ in range(3):
        x = torch.randn(1, k, generator=g).to(DEVICE, dtype)
        want = triton_ops.silu_and_mul(triton_gemv.row_gemv(x, w))
        assert torch.equal(triton_gemv.row_gemv(x, w, glu=True), want)


@pytest.mark.skipif(INTERPRET, reason="the LM head's row GEMV is taken on CUDA only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [49152, 64128, 1000])
def test_lm_head_one_row_gemv(dtype: torch.dtype, vocab: int) -> None:
    """`ParallelLMHead.compute_logits` at one 16-bit row runs the row GEMV (so that every kernel of a one-row
    decode step is ours, triton_utils.one_row_step), with float32 output where the GEMM path writes float32
    logits: within float32 summation-order noise of the exact products' sum, not rounded to 16 bits."""
    from pagedllm.model_executor.layers import vocab_embedding

    g = torch.Generator().manual_seed(vocab)
    head = vocab_embedding.ParallelLMHead(vocab, 576, params_dtype=dtype).to(DEVICE)
    head.weight.data.copy_((torch.randn(head.weight.shape, generator=g) / 24).to(dtype))
    x = torch.randn(1, 576, generator=g).to(DEVICE, dtype)
    one = head.compute_logits(x)
    ref = (x.double() @ head.weight.double().T)[:, :vocab]
    assert one.shape == (1, vocab)
    if vocab_embedding._fp32_logits_ok(x):
        assert one.dtype == torch.float32
        torch.testing.assert_close(one.double(), ref, atol=1e-4, rtol=1e-4)
        assert not torch.equal(one, one.to(dtype).float()), "logits rounded to the activation dtype"
    else:
        assert one.dtype == dtype
        torch.testing.assert_close(one.double(), ref, atol=ATOL[dtype], rtol=RTOL[dtype])


def _qkv(n_tokens: int, h: int, kvh: int, d: int, dtype: torch.dtype, g: torch.Generator):
    qkv = torch.randn(n_tokens, (h + 2 * kvh) * d, generator=g).to(DEVICE, dtype)
    return qkv, *qkv.split([h * d, kvh * d, kvh * d], dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "head_size,rotary_dim,h,kvh",
    [(64, 64, 9, 3), (128, 128, 16, 8), (128, 128, 32, 8), (128, 64, 8, 2)],
)
@pytest.mark.parametrize("n_tokens", [1, 45])
def test_rotary_in_place(dtype: torch.dtype, head_size: int, rotary_dim: int, h: int, kvh: int, n_tokens: int) -> None:
    g = torch.Generator().manual_seed(head_size * 7 + h + n_tokens)
    scaling = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}
    rope = get_rope(head_size, rotary_dim, 4096, 500000.0, scaling if head_size == 128 else None)
    rope = rope.to(DEVICE)
    positions = torch.randint(0, 4096, (n_tokens,), generator=g).to(DEVICE)
    qkv, q, k, v = _qkv(n_tokens, h, kvh, head_size, dtype, g)
    ref_q, ref_k = rope(positions, q.clone(), k.clone())
    v_before = v.clone()
    triton_rope_cache.rotary_embedding_(positions, q, k, rope.cos_sin_cache, head_size, rotary_dim)
    # Bit for bit: each product rounded as the reference rounds it (`triton_utils.mul_rn`; with plain products
    # the GPU code held FMAs, session 43).
    assert torch.equal(q, ref_q) and torch.equal(k, ref_k)
    assert torch.equal(v, v_before)  # the in-place writes stay inside q and k


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size,h,kvh", [(64, 9, 3), (128, 16, 8)])
@pytest.mark.parametrize("n_tokens", [1, 45])
def test_qk_norm_rotary_in_place(dtype: torch.dtype, head_size: int, h: int, kvh: int, n_tokens: int) -> None:
    """Qwen3: per-head RMSNorm on q and k, then RoPE, in one pass."""
    g = torch.Generator().manual_seed(head_size + h + n_tokens)
    rope = get_rope(head_size, head_size, 4096, 1000000.0).to(DEVICE)
    q_norm = _norm_module(head_size, dtype, g)
    k_norm = _norm_module(head_size, dtype, g)
    positions = torch.randint(0, 4096, (n_tokens,), generator=g).to(DEVICE)
    qkv, q, k, v = _qkv(n_tokens, h, kvh, head_size, dtype, g)
    qn = q_norm._norm(q.reshape(n_tokens, h, head_size)).reshape(n_tokens, -1)
    kn = k_norm._norm(k.reshape(n_tokens, kvh, head_size)).reshape(n_tokens, -1)
    ref_q, ref_k = rope(positions, qn, kn)
    triton_rope_cache.rotary_embedding_(
        positions, q, k, rope.cos_sin_cache, head_size, head_size, q_norm.weight, k_norm.weight, 1e-6
    )
    _close(q, ref_q)
    _close(k, ref_k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "head_size,rotary_dim,h,kvh,qk_norm",
    [(64, 64, 9, 3, False), (128, 128, 16, 8, True), (128, 64, 8, 2, False)],
)
@pytest.mark.parametrize("block_size", [16, 32])
def test_rotary_with_cache_write(
    dtype: torch.dtype, head_size: int, rotary_dim: int, h: int, kvh: int, qk_norm: bool, block_size: int
) -> None:
    """RoPE and the KV-cache write in one launch: q/k as the unfused RoPE leaves them; the cache holds the
    rotated k and v of the first `num_tokens` tokens at their slots (slot -1 and tokens past num_tokens:
    nothing written) -- exactly what `reshape_and_cache` on the rotated k would have written."""
    from pagedllm.attention.ops.triton_paged_attn import reshape_and_cache

    n_tokens, num_tokens, num_blocks = 45, 41, 8
    g = torch.Generator().manual_seed(head_size + h + block_size)
    rope = get_rope(head_size, rotary_dim, 4096, 10000.0).to(DEVICE)
    positions = torch.randint(0, 4096, (n_tokens,), generator=g).to(DEVICE)
    qkv, q, k, v = _qkv(n_tokens, h, kvh, head_size, dtype, g)
    norms = (_norm_module(head_size, dtype, g), _norm_module(head_size, dtype, g)) if qk_norm else None
    slots = torch.randperm(num_blocks * block_size, generator=g)[:n_tokens]
    slots[[3, 17]] = -1
    slots = slots.to(DEVICE)
    cache_shape = (num_blocks, block_size, kvh, head_size)
    kc, vc = (torch.full(cache_shape, 7.0, dtype=dtype, device=DEVICE) for _ in range(2))
    ref_kc, ref_vc = kc.clone(), vc.clone()

    ref_q, ref_k = q.clone(), k.clone()
    if qk_norm:
        ref_q = norms[0]._norm(ref_q.reshape(n_tokens, h, head_size)).reshape(n_tokens, -1)
        ref_k = norms[1]._norm(ref_k.reshape(n_tokens, kvh, head_size)).reshape(n_tokens, -1)
    ref_q, ref_k = rope(positions, ref_q, ref_k)
    ref_k3 = ref_k.reshape(n_tokens, kvh, head_size)
    reshape_and_cache(ref_k3[:num_tokens], v.reshape(n_tokens, kvh, head_size)[:num_tokens], ref_kc, ref_vc, slots)

    v_before = v.clone()
    weights = (norms[0].weight, norms[1].weight, 1e-6) if qk_norm else ()
    triton_rope_cache.rotary_embedding_(
        positions,
        q,
        k,
        rope.cos_sin_cache,
        head_size,
        rotary_dim,
        *weights,
        cache=triton_rope_cache.KVCacheWrite(v, kc, vc, slots, num_tokens),
    )
    _close(q, ref_q)
    _close(k, ref_k)
    assert torch.equal(v, v_before)
    assert torch.equal(vc, ref_vc)  # v is copied, never rounded
    written = kc != 7.0
    assert torch.equal(written, ref_kc != 7.0)
    # The cache holds exactly the kernel's own rotated k (bit for bit) where it wrote.
    ours_k3 = k.reshape(n_tokens, kvh, head_size)
    flat = kc.view(-1, kvh, head_size)
    for t in range(num_tokens):
        s = int(slots[t])
        if s >= 0:
            assert torch.equal(flat[s], ours_k3[t])
