"""The int8 qkv GEMV with RoPE and the K / V cache write in its epilogue (`gguf_triton.gguf_matmul_triton(...,
rope=)`, `triton_rope_cache.QKVRope`) against the two launches it replaces: the plain GEMV, then
`rotary_embedding_` with its cache write. Bit for bit: the output (q and k rotated, v as is) and the whole cache
(the new tokens' slots, nothing else touched).

    TRITON_INTERPRET=1 python tests/model_executor/gguf_qkv_rope_check.py   # prints one JSON object

`test_gguf_triton.py` runs it under the interpreter; `tests/gpu/test_gguf_gpu.py` calls `run_case` on CUDA."""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from tests.model_executor.gguf_triton_check import INT8, random_blocks

# (type, BN of the launch, activation dtype, tokens, tokens with a cache slot, head size x q heads x kv heads):
# 1 or 2 pairs a program, a padded token (slot -1) and a token past num_tokens (no write). Two small ones for
# the interpreter (CPU CI, ~15 s each), every int8 type with Llama-like heads on the GPU.
CASES = ["Q4_1-bn2-fp16-m3-n2-h32x2x1", "Q4_K-bn4-bf16-m3-n2-h32x2x1"]
GPU_CASES = [
    f"{t}-bn{bn}-{dt}-m{m}-n{nt}-h{hs}x{qh}x{kvh}"
    for t in INT8
    for bn, dt, m, nt, hs, qh, kvh in (
        (2, "fp16", 3, 3, 64, 8, 2),
        (4, "bf16", 5, 4, 128, 32, 8),
        (2, "bf16", 1, 1, 128, 4, 1),
    )
]


def run_case(case: str, device: str, flags: int = 0, preload: bool | None = None) -> dict[str, int]:
    """Mismatched elements of the output and of the cache, fused against unfused (0 and 0: the same bits);
    `flags` / `preload` for the fused launch (`GemvConfig.flags`, `gguf_gemv_triton`'s early read)."""
    import torch
    from gguf import GGMLQuantizationType

    from pagedllm.attention.ops.triton_rope_cache import KVCacheWrite, rotary_embedding_
    from pagedllm.attention.qkv_rope import QKVRope
    from pagedllm.model_executor.layers.quantization import gguf as gq
    from pagedllm.model_executor.layers.quantization import gguf_triton as gt
    from pagedllm.model_executor.layers.rotary_embedding import get_rope

    name, bn_s, dt_s, m_s, nt_s, h_s = case.split("-")
    bn, m, n_tok = int(bn_s[2:]), int(m_s[1:]), int(nt_s[1:])
    hs, qh, kvh = (int(v) for v in h_s[1:].split("x"))
    dtype = torch.float16 if dt_s == "fp16" else torch.bfloat16
    k, block = 256, 16
    n = (qh + 2 * kvh) * hs
    rng = np.random.default_rng(sum(map(ord, case)))
    g = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    raw = random_blocks(name, n, k, rng)
    w = gt.prepare(gq.GGUFWeight(int(GGMLQuantizationType[name]), torch.from_numpy(raw), n, k), device)
    x = torch.randn(m, k, generator=g).to(dtype).to(device)
    rope = get_rope(hs, hs, 4096, 500000.0).to(device)
    positions = torch.randint(0, 4096, (m,), generator=g).to(device)
    slots = torch.randperm(6 * block, generator=g)[:m]
    slots[1 % m] = -1 if m > 1 else slots[0]  # a padded token (CUDA graphs)
    slots = slots.to(device)
    cache = torch.randn(2, 6, block, kvh, hs, generator=g).to(dtype).to(device)
    cfg = gt.GemvConfig(bn, 256, 2, 1, 1)

    ref_cache = cache.clone()
    ref = torch.empty(m, n, dtype=dtype, device=device)
    gt.gguf_gemv_triton(x, w, ref, 4, cfg)
    q, kk, v = ref.split([qh * hs, kvh * hs, kvh * hs], dim=1)
    write = KVCacheWrite(v, ref_cache[0], ref_cache[1], slots, n_tok)
    rotary_embedding_(positions, q, kk, rope.cos_sin_cache, hs, hs, cache=write)

    out = torch.empty(m, n, dtype=dtype, device=device)
    spec = QKVRope(positions, rope.cos_sin_cache, slots, cache, n_tok, qh, kvh, hs)
    assert gt.rope_fits(x, [w], spec)
    gt.gguf_gemv_triton(x, w, out, 4, cfg._replace(flags=flags), preload=preload, rope=spec)
    return {
        "out": int((out.view(torch.int16) != ref.view(torch.int16)).sum()),
        "cache": int((cache.view(torch.int16) != ref_cache.view(torch.int16)).sum()),
    }


def model_case(device: str, qtype: str = "Q8_0") -> dict[str, float]:
    """A tiny float16 Llama with `qtype`-packed linears on the Triton path (the CUDA dispatch forced onto CPU
    tensors under the interpreter): a 4-token prefill and 3 decodes, `PAGEDLLM_QKV_ROPE` on and off. Returns the
    largest logit difference between the two (0: the same bits), how many qkv launches took the epilogue with it
    on and with it off. (~3 min under the interpreter: a slow test.)"""
    import tempfile

    import torch
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from pagedllm.model_executor.layers import triton_ops
    from pagedllm.model_executor.layers.linear import LinearBase
    from pagedllm.model_executor.layers.quantization import gguf as gq
    from pagedllm.model_executor.layers.quantization import gguf_triton as gt
    from pagedllm.model_executor.model_loader import load_model
    from tests.utils_model import VOCAB, PagedModelRunner, make_model_config, make_tiny_hf_model

    os.environ["PAGEDLLM_ATTENTION_BACKEND"] = "TRITON"
    if device == "cpu":
        triton_ops.use_triton_ops = lambda x: True  # type: ignore[assignment]
    with tempfile.TemporaryDirectory() as d:
        hf = make_tiny_hf_model("llama", d)
        model = load_model(make_model_config(d, hf.config, torch.float16), "auto", torch.device(device))
    qt = GGMLQuantizationType[qtype]
    for m in model.modules():
        if isinstance(m, LinearBase) and "weight" in m._parameters:
            w = m.weight.detach().float().cpu().numpy()
            raw = torch.from_numpy(quantize(w, qt))
            gq.install(m, [gt.prepare(gq.GGUFWeight(int(qt), raw, w.shape[0], w.shape[1]), device)])
    launches: list[bool] = []
    real = gt.gguf_gemv_triton

    def spy(*args: object, **kw: object) -> object:
        launches.append(kw.get("rope") is not None)
        return real(*args, **kw)  # type: ignore[arg-type]

    gt.gguf_gemv_triton = spy  # type: ignore[assignment]
    ids = torch.randint(0, VOCAB, (7,), generator=torch.Generator().manual_seed(5))
    res: dict[str, float] = {}
    logits = {}
    for flag in ("1", "0"):
        os.environ["PAGEDLLM_QKV_ROPE"] = flag
        launches.clear()
        runner = PagedModelRunner(model, num_blocks=4, block_size=16)
        out = [runner.step(ids[:4])] + [runner.step(ids[i : i + 1]) for i in range(4, 7)]
        logits[flag] = torch.cat(out).cpu()
        res[f"epilogue_launches_{flag}"] = sum(launches)
    gt.gguf_gemv_triton = real  # type: ignore[assignment]
    res["max_diff"] = float((logits["1"] - logits["0"]).abs().max())
    res["finite"] = float(bool(torch.isfinite(logits["1"]).all()))
    return res


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1 (set before triton is imported)")
    if sys.argv[1:] == ["model"]:
        print(json.dumps(model_case("cpu")))
    else:
        print(json.dumps({c: run_case(c, "cpu") for c in CASES}))
