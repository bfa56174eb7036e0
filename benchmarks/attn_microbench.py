"""Times the Triton paged-attention kernel against the device's own ceilings (run on a GPU).

    PYTHONPATH=. python3 benchmarks/attn_microbench.py [--out results.json] [--quick]

Measures, in one run: device-to-device copy bandwidth (bytes read + written) and a bf16 8192^3
matmul rate (the floors); then the decode kernel on a W1-like batch (256 requests, contexts U[500,1500],
Qwen3-0.6B attention: 16 q heads, 8 kv heads, head_dim 128, bf16, block 16) under several launch
configurations, reported as K/V bytes read / time against the copy bandwidth; the split-KV path on a
small long-context batch; a prefill batch in TFLOP/s; and the torch_native (gather + matmul) decode
for reference. Decode timings replay a CUDA graph (launch gaps removed, as the engine will run them).
Prints a table last.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics

import torch

from pagedllm.attention.ops.triton_paged_attn import (
    choose_num_splits,
    launch_config,
    paged_attention,
    reshape_and_cache,
)

H, KVH, D = 16, 8, 128  # Qwen3-0.6B attention


def bench(fn, graph: bool = True, reps: int = 5) -> float:
    """Median ms over `reps` do_bench runs (each itself a median)."""
    import triton.testing as tt

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        if graph:
            times.append(tt.do_bench_cudagraph(fn, rep=100, return_mode="median"))
        else:
            times.append(tt.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    return statistics.median(times)


def floors() -> dict:
    n = 1 << 30  # 2 GiB of bf16 per buffer: far above L2
    a = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    t = bench(lambda: b.copy_(a), graph=False, reps=3)
    copy_gbs = 2 * a.numel() * a.element_size() / (t * 1e-3) / 1e9
    m = 8192
    x = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
    y = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
    t = bench(lambda: x @ y, graph=False, reps=3)
    tflops = 2 * m**3 / (t * 1e-3) / 1e12
    return {"copy_GBps": copy_gbs, "bf16_matmul_TFLOPs": tflops}


class DecodeBatch:
    """Random paged decode batch with randomly permuted block ids (a fragmented cache)."""

    def __init__(self, seq_lens: list[int], block_size: int, dtype=torch.bfloat16, seed: int = 0) -> None:
        g = torch.Generator(device="cpu").manual_seed(seed)
        self.seq_lens_list = seq_lens
        n = len(seq_lens)
        nblk = [math.ceil(s / block_size) for s in seq_lens]
        num_blocks = sum(nblk) + 1
        perm = torch.randperm(num_blocks, generator=g)
        self.block_table = torch.zeros(n, max(nblk), dtype=torch.int32)
        i = 0
        for r, k in enumerate(nblk):
            self.block_table[r, :k] = perm[i : i + k].to(torch.int32)
            i += k
        self.block_table = self.block_table.cuda()
        shape = (num_blocks, block_size, KVH, D)
        self.k_cache = torch.randn(shape, dtype=dtype, device="cuda")
        self.v_cache = torch.randn(shape, dtype=dtype, device="cuda")
        self.q = torch.randn(n, H, D, dtype=dtype, device="cuda")
        self.out = torch.empty_like(self.q)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
        self.qsl = torch.arange(n + 1, dtype=torch.int32, device="cuda")
        self.kv_bytes = sum(seq_lens) * KVH * D * 2 * self.k_cache.element_size()
        self.io_bytes = self.kv_bytes + 2 * self.q.numel() * self.q.element_size() + self.block_table.numel() * 4
        self.workspace: dict = {}

    def run(self, num_splits: int = 1, **cfg) -> torch.Tensor:
        n = len(self.seq_lens_list)
        return paged_attention(
            self.q,
            self.k_cache,
            self.v_cache,
            self.out,
            self.block_table,
            self.seq_lens,
            self.qsl,
            num_actual_tokens=n,
            num_reqs=n,
            max_query_len=1,
            scale=D**-0.5,
            num_splits=num_splits,
            workspace=self.workspace,
            **cfg,
        )

    def torch_ref(self) -> torch.Tensor:
        from pagedllm.attention.backends.abstract import AttentionType
        from pagedllm.attention.backends.torch_native import TorchNativeAttentionImpl, TorchNativeMetadata

        impl = TorchNativeAttentionImpl(H, D, D**-0.5, KVH, None, AttentionType.DECODER)
        n = len(self.seq_lens_list)
        md = TorchNativeMetadata(
            slot_mapping=torch.empty(0, dtype=torch.long, device="cuda"),
            num_actual_tokens=n,
            causal=True,
            decode_token_idx=torch.arange(n, device="cuda"),
            decode_block_table=self.block_table.long(),
            decode_seq_lens=self.seq_lens,
            prefills=[],
            spans=[],
        )
        return impl._decode(self.q, self.k_cache, self.v_cache, md)


def random_decode_batch(h: int, kvh: int, batch: int, lo: int, hi: int) -> DecodeBatch:
    """A decode batch of `batch` requests with contexts drawn from U[lo, hi] (seeded by the batch size), for
    `h` query and `kvh` kv heads (set as this module's H / KVH)."""
    global H, KVH
    H, KVH = h, kvh
    g = torch.Generator().manual_seed(batch)
    return DecodeBatch(torch.randint(lo, hi + 1, (batch,), generator=g).tolist(), 16)


def long_batch(n: int, ctx: int, record) -> None:
    """n requests of ctx tokens each, through every split count (checked against the unsplit result)."""
    b = DecodeBatch([ctx] * n, 16, seed=n)
    auto = choose_num_splits(n, KVH, 1, torch.device("cuda"))
    base = b.run().clone()
    for s in sorted({1, 2, 4, 8, 16, auto}):
        e = rel_err(b.run(num_splits=s), base)
        assert e < 1e-2, (s, e)
        tag = " (auto)" if s == auto else ""
        record(f"{n}x{ctx} decode split={s}{tag}", b, bench(lambda s=s: b.run(num_splits=s)))


def mixed_batch() -> dict:
    """W1-like mixed step: 255 decodes (contexts U[500,1500]) + one 512-token chunk after a 512-token prefix.

    One launch with chunk-sized tiles for all vs two launches (decode tiles for the decodes), and the
    two parts alone.
    """
    g = torch.Generator().manual_seed(3)
    ctx = torch.randint(500, 1501, (256,), generator=g).tolist()
    q_lens = [1] * 256
    ctx[100], q_lens[100] = 512, 512
    seq = [c + q for c, q in zip(ctx, q_lens)]
    bs = 16
    nblk = [math.ceil(x / bs) for x in seq]
    perm = torch.randperm(sum(nblk) + 1, generator=g)
    bt = torch.zeros(256, max(nblk), dtype=torch.int32)
    i = 0
    for r, k in enumerate(nblk):
        bt[r, :k] = perm[i : i + k].to(torch.int32)
        i += k
    bt = bt.cuda()
    shape = (sum(nblk) + 1, bs, KVH, D)
    kc = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    vc = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    t = sum(q_lens)
    q = torch.randn(t, H, D, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    sl = torch.tensor(seq, dtype=torch.int32, device="cuda")

    def run(num_decodes):
        return paged_attention(
            q,
            kc,
            vc,
            out,
            bt,
            sl,
            qsl,
            num_actual_tokens=t,
            num_reqs=256,
            max_query_len=512,
            scale=D**-0.5,
            num_decodes=num_decodes,
        )

    one = run(None).clone()
    two = run(255).clone()
    res = {"rel_err_one_vs_two": rel_err(one, two)}
    assert res["rel_err_one_vs_two"] < 1e-2
    res["one_launch_ms"] = bench(lambda: run(None), graph=False, reps=3)
    res["two_launches_ms"] = bench(lambda: run(255), graph=False, reps=3)
    # The chunk alone (its request only) and the decodes alone (max_query_len 1), same buffers.
    sel = [r for r in range(256) if r != 100]
    dq = torch.arange(256, device="cuda")[torch.tensor(sel, device="cuda")]
    d_qsl = torch.arange(256, dtype=torch.int32, device="cuda")
    d_q = q[qsl[dq].long()].contiguous()
    d_out = torch.empty_like(d_q)
    d_bt, d_sl = bt[dq].contiguous(), sl[dq].contiguous()
    res["decodes_alone_ms"] = bench(
        lambda: paged_attention(
            d_q, kc, vc, d_out, d_bt, d_sl, d_qsl, num_actual_tokens=255, num_reqs=255, max_query_len=1, scale=D**-0.5
        ),
        graph=False,
        reps=3,
    )
    c_qsl = torch.tensor([0, 512], dtype=torch.int32, device="cuda")
    c_q = q[100:612].contiguous()
    c_out = torch.empty_like(c_q)
    res["chunk_alone_ms"] = bench(
        lambda: paged_attention(
            c_q,
            kc,
            vc,
            c_out,
            bt[100:101].contiguous(),
            sl[100:101].contiguous(),
            c_qsl,
            num_actual_tokens=512,
            num_reqs=1,
            max_query_len=512,
            scale=D**-0.5,
        ),
        graph=False,
        reps=3,
    )
    print(
        "mixed 255 decodes + 512-token chunk: "
        + ", ".join(f"{k} {v * 1e3:.1f} us" for k, v in res.items() if k.endswith("_ms")),
        flush=True,
    )
    return res


PREFILL_TILES = (
    (128, 32, 8, 3),
    (128, 32, 4, 3),
    (128, 64, 8, 3),
    (128, 64, 4, 3),
    (64, 64, 4, 3),
    (128, 32, 4, 4),
    (128, 128, 8, 2),
    (64, 32, 4, 3),
)


def prefill_case(n: int, L: int, h: int, kvh: int, quick: bool = False) -> tuple[dict, tuple]:
    """Causal attention of n fresh L-token prompts (bf16, block 16, permuted blocks) under several tile
    configs, with and without the reverse tile order, and torch SDPA on the dense tensors, in TFLOP/s."""
    bs = 16
    num_blocks = n * L // bs
    kc = torch.empty(num_blocks, bs, kvh, D, dtype=torch.bfloat16, device="cuda")
    vc = torch.empty_like(kc)
    bt = torch.randperm(num_blocks, device="cuda").to(torch.int32).view(n, L // bs)
    pos = torch.arange(L, device="cuda")
    slots = (bt.long()[:, pos // bs] * bs + pos % bs).flatten()
    q = torch.randn(n * L, h, D, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(n * L, kvh, D, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(n * L, kvh, D, dtype=torch.bfloat16, device="cuda")
    reshape_and_cache(k, v, kc, vc, slots)
    out = torch.empty_like(q)
    qsl = torch.arange(0, n * L + 1, L, dtype=torch.int32, device="cuda")
    sl = torch.full((n,), L, dtype=torch.int32, device="cuda")

    def prefill(**cfg):
        return paged_attention(
            q, kc, vc, out, bt, sl, qsl, num_actual_tokens=n * L, num_reqs=n, max_query_len=L, scale=D**-0.5, **cfg
        )

    flops = 4 * n * h * D * (L * (L + 1) / 2)  # causal: QK^T and PV over the lower triangle
    qh = q.view(n, L, h, D).transpose(1, 2)
    kh = k.view(n, L, kvh, D).transpose(1, 2)
    vh = v.view(n, L, kvh, D).transpose(1, 2)

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)

    e = rel_err(prefill().view(n, L, h, D).transpose(1, 2), sdpa())
    assert e < 2e-2, e
    shape = f"{n}x{L} h{h}/{kvh}"
    pre: dict = {"shape": shape, "rel_err_vs_sdpa": e, "default_config": launch_config(D, h // kvh, torch.bfloat16, L)}
    variants: list[tuple[str, object]] = [("triton default", prefill)]
    for bm, tn, nw, ns in PREFILL_TILES[: 3 if quick else None]:
        cfg = dict(block_m=bm, tile_n=tn, num_warps=nw, num_stages=ns)
        variants.append((f"triton m{bm} n{tn} w{nw} s{ns}", lambda cfg=cfg: prefill(**cfg)))
    variants.append(("torch SDPA (dense, causal)", sdpa))
    variants += varlen_candidates(q, k, v, qsl, L, n, h, kvh, qh, kh, vh)
    for name, fn in variants:
        try:
            ms = bench(fn, graph=False, reps=3)
        except Exception as e:  # an out-of-resources config: report, go on
            print(f"prefill {shape} {name}: failed: {type(e).__name__}: {str(e)[:200]}")
            continue
        pre[name] = {"ms": ms, "TFLOPs": flops / (ms * 1e-3) / 1e12}
        print(f"prefill {shape} {name:32s} {ms * 1e3:9.1f} us {pre[name]['TFLOPs']:6.1f} TFLOP/s", flush=True)
    return pre, (k, v, kc, vc, slots)


def varlen_candidates(q, k, v, qsl, L, n, h, kvh, qh, kh, vh) -> list[tuple[str, object]]:  # noqa: ANN001
    """Library kernels a fresh-prompt prefill could call instead of the paged kernel (its keys are the step's own,
    contiguous): FlashAttention-2's varlen entry point in aten (what a ragged batch needs), torch's `varlen_attn`
    where this PyTorch has it (its signature changed between releases), and SDPA with one backend forced on the
    dense [n, h, L, D] tensors (W2's equal-length chunks). Each is checked against SDPA's default first; one that
    fails or disagrees is reported and left out."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    scale = D**-0.5
    ref = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
    ref_t = ref.transpose(1, 2).reshape(n * L, h, D)

    def aten_flash():
        return torch.ops.aten._flash_attention_forward(q, k, v, qsl, qsl, L, L, 0.0, True, False, scale=scale)[0]

    def torch_varlen():
        import inspect

        from torch.nn.attention.varlen import varlen_attn

        params = inspect.signature(varlen_attn).parameters
        causal = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
        gqa = {"enable_gqa": True} if "enable_gqa" in params else {}
        return varlen_attn(q, k, v, qsl, qsl, L, L, scale=scale, **causal, **gqa)

    def forced(backend):  # noqa: ANN001, ANN202
        def run():
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)

        return run

    out: list[tuple[str, object]] = []
    cands = [("aten flash varlen (FA2)", aten_flash, True), ("torch varlen_attn", torch_varlen, True)]
    for b in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        cands.append((f"SDPA dense {b.name}", forced(b), False))
    for name, fn, ragged in cands:
        try:
            got = fn()
            e = rel_err(got.view(n * L, h, D) if ragged else got.transpose(1, 2).reshape(n * L, h, D), ref_t)
        except Exception as exc:  # not in this PyTorch / not for these shapes
            print(f"prefill {name}: unavailable: {type(exc).__name__}: {str(exc)[:160]}")
            continue
        if e > 2e-2:
            print(f"prefill {name}: relative error {e:.3g} against SDPA: left out")
            continue
        out.append((f"{name} (err {e:.1e})", fn))
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="fewer variants")
    ap.add_argument(
        "--prefill-only",
        action="store_true",
        help="only the prefill sweeps: 16x1024, W4's 8x2048 chunks, W2's (Llama-8B heads) 8x2048",
    )
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.cuda.get_device_properties(0)
    res: dict = {"device": dev.name, "sms": dev.multi_processor_count, "torch": torch.__version__}
    import triton

    res["triton"] = triton.__version__
    res["floors"] = fl = floors()
    copy = fl["copy_GBps"]
    print(f"floors: copy {copy:.0f} GB/s, bf16 matmul {fl['bf16_matmul_TFLOPs']:.0f} TFLOP/s", flush=True)

    if args.prefill_only:
        res["prefill"] = [
            prefill_case(n, L, h, kvh)[0] for n, L, h, kvh in ((16, 1024, H, KVH), (8, 2048, H, KVH), (8, 2048, 32, 8))
        ]
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)
        for pre in res["prefill"]:
            best = max(
                (k for k, r in pre.items() if isinstance(r, dict) and k.startswith("triton")),
                key=lambda k: pre[k]["TFLOPs"],
            )
            sdpa_t = pre.get("torch SDPA (dense, causal)", {}).get("TFLOPs", float("nan"))
            print(
                f"| prefill {pre['shape']} | default {pre['triton default']['TFLOPs']:.0f} | "
                f"best {best} "
                f"{pre[best]['TFLOPs']:.0f} | SDPA {sdpa_t:.0f} TFLOP/s |"
            )
        return

    rows: list[dict] = []

    def record(name: str, batch: DecodeBatch, ms: float, extra: dict | None = None) -> None:
        gbs = batch.io_bytes / (ms * 1e-3) / 1e9
        row = {"case": name, "ms": ms, "GBps": gbs, "pct_copy": 100 * gbs / copy, **(extra or {})}
        rows.append(row)
        print(f"{name:48s} {ms * 1e3:9.1f} us {gbs:7.0f} GB/s {row['pct_copy']:5.1f}%", flush=True)

    # ---- W1-like decode: 256 requests x ~1000 context ------------------------------------------
    g = torch.Generator().manual_seed(1)
    lens = torch.randint(500, 1501, (256,), generator=g).tolist()
    w1 = DecodeBatch(lens, 16)
    res["w1_decode"] = {
        "num_reqs": 256,
        "mean_ctx": sum(lens) / 256,
        "kv_MB": w1.kv_bytes / 1e6,
        "default_config": launch_config(D, H // KVH, torch.bfloat16, 1),
        "default_splits": choose_num_splits(256, KVH, 1, torch.device("cuda")),
    }
    ref = w1.torch_ref()
    err = rel_err(w1.run(), ref)
    res["w1_decode"]["rel_err_vs_torch"] = err
    print(f"W1 decode rel err vs torch_native: {err:.2e}")
    assert err < 2e-2, err
    record("W1 decode default", w1, bench(lambda: w1.run()))
    record("W1 decode default (repeat)", w1, bench(lambda: w1.run()))
    variants = [
        dict(tile_n=32),
        dict(tile_n=64),
        dict(tile_n=256),
        dict(num_stages=3),
        dict(num_stages=4),
        dict(num_warps=2),
        dict(num_warps=8),
        dict(tile_n=64, num_stages=3),
    ]
    if args.quick:
        variants = variants[:3]
    for cfg in variants:
        name = "W1 decode " + ",".join(f"{k}={v}" for k, v in cfg.items())
        try:
            record(name, w1, bench(lambda cfg=cfg: w1.run(**cfg)), {"cfg": cfg})
        except Exception as e:  # an out-of-resources config: report, go on
            print(f"{name}: failed: {type(e).__name__}: {str(e)[:200]}")
    for s in (2, 4):
        record(f"W1 decode split={s}", w1, bench(lambda s=s: w1.run(num_splits=s)))
    w1_64 = DecodeBatch(lens, 64)
    record("W1 decode block_size=64", w1_64, bench(lambda: w1_64.run()))
    t_ref = bench(lambda: w1.torch_ref(), graph=False, reps=3)
    record("W1 decode torch_native (gather+matmul)", w1, t_ref)

    # ---- few long requests: where split-KV matters --------------------------------------------
    for n, ctx in ((8, 8000), (32, 4000)):
        long_batch(n, ctx, record)

    try:
        res["mixed"] = mixed_batch()
    except Exception as e:  # report and go on to the prefill figures
        res["mixed"] = {"error": f"{type(e).__name__}: {e}"}
        print("mixed batch failed:", res["mixed"]["error"], flush=True)

    # ---- prefill: fresh prompts (16 x 1024 here; --prefill-only adds W4's and W2's chunk shapes) -----
    pre, (k, v, kc, vc, slots) = prefill_case(16, 1024, H, KVH, quick=args.quick)
    res["prefill_16x1024"] = pre
    cache_ms = bench(lambda: reshape_and_cache(k, v, kc, vc, slots), graph=False, reps=3)
    cache_bytes = 2 * 2 * k.numel() * k.element_size()
    res["reshape_and_cache_16k_tokens"] = {"ms": cache_ms, "GBps": cache_bytes / (cache_ms * 1e-3) / 1e9}
    res["decode"] = rows

    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)

    print("\n| case | us | GB/s | % copy |")
    print("| --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['case']} | {r['ms'] * 1e3:.1f} | {r['GBps']:.0f} | {r['pct_copy']:.1f} |")
    print(
        f"floors: copy {copy:.0f} GB/s; bf16 matmul {fl['bf16_matmul_TFLOPs']:.0f} TFLOP/s; "
        f"reshape_and_cache {res['reshape_and_cache_16k_tokens']['GBps']:.0f} GB/s"
    )
    mx = res["mixed"]
    print(
        "mixed 255 decodes + 512 chunk (us): "
        + ", ".join(f"{k[:-3]} {v * 1e3:.1f}" for k, v in mx.items() if k.endswith("_ms"))
        + str(mx.get("error", ""))
    )
    for name, r in pre.items():
        if isinstance(r, dict):
            print(f"prefill 16x1024 {name}: {r['ms'] * 1e3:.0f} us, {r['TFLOPs']:.0f} TFLOP/s")


if __name__ == "__main__":
    main()
