"""Acceptance 1: the packed GGUF kernels (`pagedllm/csrc/gguf_mm.c`) against the `gguf` package's own
reference dequantization (`gguf.quants.dequantize`) times a float32 matmul, for every supported type, odd
shapes, every instruction-set level this CPU has (AVX-512 VNNI, AVX2, portable C)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from pagedllm.model_executor.layers.quantization import gguf as gq

pytestmark = pytest.mark.skipif(not gq.kernels_available(), reason="no C compiler: GGUF kernels not built")

TYPES = [GGMLQuantizationType[name] for name in gq.PACKED_TYPES.values()]
# Offsets of the float16 scale fields inside each block (random bytes there could be inf/NaN).
_F16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}
# (M, N, K blocks); 40 blocks of 32 span three of the column-tile kernel's 16-block panels
SHAPES = [(1, 1, 1), (1, 37, 3), (3, 64, 5), (5, 19, 2), (17, 8, 1), (64, 33, 4), (9, 21, 40)]


def random_blocks(qtype: GGMLQuantizationType, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Weights in `qtype`: quantized from floats by gguf's own quantizer where it has one, else random
    block bytes with small finite float16 scales (every bit pattern of the quant fields is exercised)."""
    qk, nbytes = GGML_QUANT_SIZES[qtype]
    try:
        return gguf_quantize(rng.standard_normal((rows, cols)).astype(np.float32) * 0.1, qtype)
    except NotImplementedError:
        pass
    raw = rng.integers(0, 256, size=(rows, cols // qk, nbytes), dtype=np.uint8)
    for off in _F16_FIELDS[qtype.name]:
        scale = rng.uniform(-0.02, 0.02, size=(rows, cols // qk)).astype(np.float16)
        raw[:, :, off : off + 2] = scale.view(np.uint8).reshape(rows, cols // qk, 2)
    return raw.reshape(rows, -1)


def activation_reference(x: torch.Tensor) -> torch.Tensor:
    """The int16-per-32 activations the kernels multiply with, dequantized (float64)."""
    xq, xd, _ = gq.quantize_activations(x)
    return (xq.double().view(x.shape[0], -1, 32) * xd.double()[..., None]).view(x.shape)


def quantize_spec(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The activation quantization, written out in float32 numpy: d = amax / 32767 per block of 32,
    q = roundf(x / d) (half away from zero), xs = d * sum(q)."""
    v = x.astype(np.float32).reshape(x.shape[0], -1, 32)
    d = np.abs(v).max(axis=-1) / np.float32(32767)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, np.float32(1)), np.float32(0)).astype(np.float32)
    y = v * inv[..., None]
    t = np.trunc(y)
    q = (t + np.where(np.abs(y - t) >= 0.5, np.sign(y), 0)).astype(np.int16)
    return q.reshape(x.shape), d, (d * q.astype(np.int32).sum(axis=-1).astype(np.float32)).astype(np.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_quantization_is_the_spec(dtype: torch.dtype) -> None:
    """Bit for bit, ties included: a float32 block whose amax is 32767 * 2^-8 puts each odd multiple of 2^-9 on a
    rounding tie; zero blocks give zero scales."""
    rng = np.random.default_rng(3)
    x = torch.from_numpy(rng.standard_normal((37, 96)).astype(np.float32) * 3).to(dtype)
    ties = np.arange(-16, 16, dtype=np.float32) * 2.0**-8 + 2.0**-9
    x[0, :32] = torch.from_numpy(ties).to(dtype)
    x[0, 31] = 32767 * 2.0**-8
    x[1, 32:64] = 0
    xq, xd, xs = gq.quantize_activations(x)
    q, d, s = quantize_spec(x.float().numpy())
    assert np.array_equal(xq.numpy(), q)
    assert np.array_equal(xd.numpy(), d.reshape(xd.shape))
    assert np.array_equal(xs.numpy(), s.reshape(xs.shape))
    assert np.all(xq[1, 32:64].numpy() == 0) and xd[1, 1] == 0


@pytest.fixture(params=[0, 1, 2], ids=["portable", "avx2", "avx512vnni"])
def isa(request: pytest.FixtureRequest):  # noqa: ANN201
    if gq.set_isa(request.param) != request.param:
        gq.set_isa(-1)
        pytest.skip(f"this CPU has no ISA level {request.param}")
    yield request.param
    gq.set_isa(-1)


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_dequantize_matches_gguf(qtype: GGMLQuantizationType) -> None:
    rng = np.random.default_rng(int(qtype))
    qk = GGML_QUANT_SIZES[qtype][0]
    raw = random_blocks(qtype, 7, 3 * qk, rng)
    w = gq.GGUFWeight(int(qtype), torch.from_numpy(raw), 7, 3 * qk)
    ref = gguf_dequantize(raw, qtype).reshape(7, 3 * qk)
    np.testing.assert_array_equal(gq.dequantize(w).numpy(), ref)


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matmul_matches_gguf_reference(qtype: GGMLQuantizationType, shape: tuple[int, int, int], isa: int) -> None:
    m, n, kb = shape
    qk = GGML_QUANT_SIZES[qtype][0]
    k = kb * qk
    rng = np.random.default_rng(m * 1000 + n * 10 + kb)
    raw = random_blocks(qtype, n, k, rng)
    w_ref = torch.from_numpy(gguf_dequantize(raw, qtype).reshape(n, k).astype(np.float32)).double()
    w = gq.GGUFWeight(int(qtype), torch.from_numpy(raw), n, k)
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
    y = gq.gguf_matmul(x, [w]).double()
    assert y.shape == (m, n)
    # Exact up to float32 rounding against the quantized activations the kernel used...
    ref_q = activation_reference(x) @ w_ref.T
    scale = (activation_reference(x).abs() @ w_ref.abs().T).clamp_min(1e-30)
    assert ((y - ref_q).abs() / scale).max() < 2e-6
    # ...and within the activation rounding (half a step of amax / 32767 per element) of float32 x.
    ref = x.double() @ w_ref.T
    bound = (x.double().abs().view(m, -1, 32).amax(-1, keepdim=True) / 65534).expand(m, k // 32, 32).reshape(m, k)
    assert ((y - ref).abs() <= bound @ w_ref.abs().T + 1e-5 * scale).all()


TILE_TYPES = [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0]


@pytest.mark.parametrize("qtype", TILE_TYPES, ids=[t.name for t in TILE_TYPES])
def test_tile_kernel_is_batch_invariant(qtype: GGMLQuantizationType) -> None:
    """AVX-512 VNNI's column-tile kernel gives every activation row the same bits whatever the number of rows
    beside it (1 and 2-4 rows take its few-row path, more its transposed panels), and agrees with the row
    kernels it replaced up to float32 rounding."""
    if gq.set_isa(2) != 2:
        gq.set_isa(-1)
        pytest.skip("this CPU has no AVX-512 VNNI")
    try:
        rng = np.random.default_rng(int(qtype))
        n, k = 53, 32 * 37
        w = gq.GGUFWeight(int(qtype), torch.from_numpy(random_blocks(qtype, n, k, rng)), n, k)
        x = torch.from_numpy(rng.standard_normal((19, k)).astype(np.float32))
        full = gq.gguf_matmul(x, [w])
        for rows in (slice(0, 1), slice(5, 8), slice(3, 7), slice(0, 9), slice(2, 19)):
            assert torch.equal(gq.gguf_matmul(x[rows], [w]), full[rows]), rows
        for i in (0, 11, 18):
            assert torch.equal(gq.gguf_matmul(x[i : i + 1], [w]), full[i : i + 1])
        previous = gq.set_tile(False)
        try:
            rows_kernel = gq.gguf_matmul(x, [w])
        finally:
            gq.set_tile(previous)
        torch.testing.assert_close(full, rows_kernel, rtol=1e-5, atol=1e-5 * float(rows_kernel.abs().max()))
    finally:
        gq.set_isa(-1)


@pytest.mark.parametrize("qtype", TILE_TYPES, ids=[t.name for t in TILE_TYPES])
def test_tiled_layout_is_the_same_weight(qtype: GGMLQuantizationType, isa: int) -> None:
    """`gguf.tile`'s re-laid weight (made where AVX-512 VNNI runs) multiplies to the file layout's bits at every
    row count, dequantizes to the same floats, and still works on every ISA level and with the tile kernel off
    (those take the file's layout back)."""
    if gq.set_isa(-1) != 2:
        pytest.skip("the tiled layout is made only where AVX-512 VNNI runs")
    rng = np.random.default_rng(100 + int(qtype))
    n, k = 37, 32 * 21  # a partial last tile, two panels
    raw = random_blocks(qtype, n, k, rng)
    w = gq.GGUFWeight(int(qtype), torch.from_numpy(raw), n, k)
    tiled = gq.tile(w)
    gq.set_isa(isa)
    assert tiled.qtype == int(qtype) | gq.TILED and tiled.type_name == qtype.name
    assert torch.equal(gq.dequantize(tiled), gq.dequantize(w))
    x = torch.from_numpy(rng.standard_normal((19, k)).astype(np.float32))
    for m in (1, 3, 8, 19):
        assert torch.equal(gq.gguf_matmul(x[:m], [tiled]), gq.gguf_matmul(x[:m], [w])), m
    previous = gq.set_tile(False)
    try:
        assert torch.equal(gq.gguf_matmul(x, [tiled]), gq.gguf_matmul(x, [w]))
    finally:
        gq.set_tile(previous)


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q6_K], ids=["Q4_1", "Q6_K"])
def test_bf16_activations_and_parts(qtype: GGMLQuantizationType) -> None:
    """bfloat16 in and out, several parts of mixed types stacked by rows (a fused layer), a bias."""
    rng = np.random.default_rng(7)
    k = 512
    raw_a = random_blocks(qtype, 48, k, rng)
    raw_b = random_blocks(GGMLQuantizationType.Q8_0, 16, k, rng)
    parts = [
        gq.GGUFWeight(int(qtype), torch.from_numpy(raw_a), 48, k),
        gq.GGUFWeight(int(GGMLQuantizationType.Q8_0), torch.from_numpy(raw_b), 16, k),
    ]
    x = torch.randn(3, 2, k).to(torch.bfloat16)
    bias = torch.randn(64).to(torch.bfloat16)
    y = gq.gguf_matmul(x, parts, bias)
    assert y.shape == (3, 2, 64) and y.dtype == torch.bfloat16
    w = torch.cat([torch.from_numpy(gguf_dequantize(r, t).reshape(-1, k)) for r, t in ((raw_a, qtype), (raw_b, 8))])
    x2 = x.reshape(6, k).float()
    ref = (activation_reference(x2) @ w.double().T + bias.double()).view(3, 2, 64)
    torch.testing.assert_close(y.double(), ref, atol=0.02, rtol=0.01)  # bf16 output rounding
    assert gq.gguf_matmul(x[:0], parts).shape == (0, 2, 64)


def test_fused_parts_equal_each_part_alone() -> None:
    """One `gguf_mm_parts` call for weights stacked by rows (mixed tile types, file and tiled layouts, partial
    tiles, five parts: two calls) gives each part's columns the bits of that part multiplied alone, at row
    counts below, at and past the kernel's 64-row chunks."""
    rng = np.random.default_rng(3)
    k = 32 * 19
    types = [GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0,
             GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q6_K]  # fmt: skip
    k6 = 256 * 3  # the five-part stack (with a Q6_K, K % 256 == 0): two calls, the second by rows
    parts = [
        gq.GGUFWeight(int(t), torch.from_numpy(random_blocks(t, n, k, rng)), n, k)
        for t, n in zip(types[:4], (37, 16, 9, 50))
    ]
    if gq.set_isa(-1) == 2:
        parts[3] = gq.tile(parts[3])
    x = torch.from_numpy(rng.standard_normal((130, k)).astype(np.float32))
    for m in (1, 3, 64, 70, 130):
        alone = torch.cat([gq.gguf_matmul(x[:m], [p]) for p in parts], dim=-1)
        assert torch.equal(gq.gguf_matmul(x[:m], parts), alone), m
    five = [gq.GGUFWeight(int(t), torch.from_numpy(random_blocks(t, 24, k6, rng)), 24, k6) for t in types]
    x6 = torch.from_numpy(rng.standard_normal((5, k6)).astype(np.float32))
    alone = torch.cat([gq.gguf_matmul(x6, [p]) for p in five], dim=-1)
    assert torch.equal(gq.gguf_matmul(x6, five), alone)


@pytest.mark.parametrize("qtype", TILE_TYPES, ids=[t.name for t in TILE_TYPES])
def test_tile_pairs_equal_single_tiles(qtype: GGMLQuantizationType) -> None:
    """Tiled weights whose rows come in whole pairs of 16-row tiles take `two_tiles` past 16 activation rows: the
    bits of the file layout's single-tile panels and of each row alone (row groups of 4 with remainders, 64-row
    chunks, three 16-block panels, float32 and bfloat16 out, in a fused call beside a part that cannot pair)."""
    if gq.set_isa(-1) != 2:
        pytest.skip("the tiled layout is made only where AVX-512 VNNI runs")
    rng = np.random.default_rng(200 + int(qtype))
    k = 32 * 37
    file_parts = [gq.GGUFWeight(int(qtype), torch.from_numpy(random_blocks(qtype, n, k, rng)), n, k) for n in (64, 32)]
    file_parts.append(gq.GGUFWeight(int(qtype), torch.from_numpy(random_blocks(qtype, 48, k, rng)), 48, k))
    tiled = [gq.tile(p) for p in file_parts]
    x = torch.from_numpy(rng.standard_normal((133, k)).astype(np.float32))
    for m in (17, 18, 19, 20, 64, 70, 133):
        for w, t in zip(file_parts, tiled):
            assert torch.equal(gq.gguf_matmul(x[:m], [t]), gq.gguf_matmul(x[:m], [w])), (m, w.rows)
        assert torch.equal(gq.gguf_matmul(x[:m], tiled), gq.gguf_matmul(x[:m], file_parts)), m
    full = gq.gguf_matmul(x, tiled)
    for i in (0, 17, 66, 132):
        assert torch.equal(gq.gguf_matmul(x[i : i + 1], tiled), full[i : i + 1]), i
    xb = x[:37].to(torch.bfloat16)
    assert torch.equal(gq.gguf_matmul(xb, tiled), gq.gguf_matmul(xb, file_parts))


def test_unsupported_shape_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="multiple of 256"):
        gq.row_bytes(int(GGMLQuantizationType.Q4_K), 100)
