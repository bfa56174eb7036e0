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


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1 (set before triton is imported)")
    print(json.dumps({c: run_case(c, "cpu") for c in CASES}))
