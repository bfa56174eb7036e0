"""Issue 20, acceptance 4: GGUF weights kept packed on the GPU (Triton kernels, `quantization.gguf_triton`).

    PYTHONPATH=. python3 benchmarks/gguf_gpu.py --json $OUT/gguf.json [--types Q4_1 Q8_0 Q4_K] [--sweep]
        [--profile [--profile-ab]] [--tuned SWEEP_JSON] [--skip-gemv] [--ab NAME=VALUE ...]

1. Per-layer decode GEMVs (M = 1, bf16 activations) of Llama-3.1-8B's shapes (qkv, o, gate_up, down, LM
   head) per type, random packed weights made on the GPU: each checked against the dequantized float32
   product (`gguf_triton.dequantize`, itself checked against the `gguf` package in the tests), then timed
   inside a CUDA graph (`triton.testing.do_bench_cudagraph`) against its packed-bytes floor.
2. W3 (../shared/workloads/README.md: batch 1, 128 prompt tokens, 256 output tokens, greedy; ms per token =
   (median wall of a 256-token request - median wall of a 1-token request) / 255) on a Llama-3.1-8B-shaped
   engine (benchmarks/workloads/llama-3.1-8b, dummy bf16 weights, decode CUDA graphs): first bf16 as loaded
   (the same-run baseline), then every linear layer and the LM head swapped for random packed weights of
   each type (the dense weights dropped) and the decode graphs captured again. Floor = bytes a decode step
   reads (packed weights + the remaining parameters but the input embedding) / the copy bandwidth measured
   in this run (`pagedllm.benchmarks.floors`). The target is <= 1.4x. Compare W3 figures between runs of the same
   kind: after section 1 the packed W3s ran 0.05-0.09 ms slower than in a `--skip-gemv` run (bf16 the same; two
   machines, cause not found; session 44, calls 4 and 5).

   With --profile, one more 64-token request per model under the torch profiler: each decode step's (CUDA
   graph's) device span and the kernels it spends it on (`dp_scaling.graph_steps`), so the GEMVs' share and
   the fixed rest (attention, norms, RoPE, sampling) are read apart: per kernel its summed durations and its
   share of the step's critical path (end minus the previous kernel's end; PDL kernels start early and wait),
   and the same shares per launch shape (kernel and grid; a shape launched several times a layer apart by its
   place in the layer), which tells a layer's GEMVs apart. --profile-ab profiles every --ab run too.
   --ab NAME=VALUE ...: W3 of each type (bf16 too, for settings of the environment alone) again under each
   environment setting (e.g. PAGEDLLM_GGUF_GEMV_PRELOAD=0, PAGEDLLM_ATTN_DECODE_SPLITS=4) or decode-GEMV
   launch (TUNED:Q4_1:6144x4096=4/4096/4/1/1, a `gguf_triton.TUNED` entry), several joined by commas, the
   twins linked and the decode graphs captured again, in the same process; every W3 keeps its greedy tokens
   in the JSON (same weights: kernels that change no value give the same tokens), and the A/B line says how
   many of them agree with the run without.

3. --sweep (instead of 1 and 2): per type and shape, a bounded set of decode-GEMV launches (`sweep_configs`:
   tile BN x BK, warps, split-K) each checked once against the reference and timed in a CUDA graph
   (rep 20 ms); prints every row, the best per (type, shape) and the lines to paste into
   `gguf_triton.TUNED`; the JSON gets them under "sweep". About 3-4 minutes for the three default types.

No 8B GGUF file is written: the packed bytes are random (quants uniform, float16 scales small and finite),
which changes no timing (every byte is read either way).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from typing import Any

import torch
from triton.testing import do_bench_cudagraph

from pagedllm import triton_utils
from pagedllm.benchmarks import floors
from pagedllm.model_executor.layers.quantization import act_twin
from pagedllm.model_executor.layers.quantization import gguf as gq
from pagedllm.model_executor.layers.quantization import gguf_triton as gt

MODEL = "benchmarks/workloads/llama-3.1-8b"
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}  # (N, K)  # fmt: skip
TYPE_IDS = {v: k for k, v in gq.PACKED_TYPES.items()}
# Offsets of the float16 fields in each block (random bytes there could be inf / NaN).
_F16 = {"Q4_0": [0], "Q4_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def random_packed(name: str, n: int, k: int, gen: torch.Generator) -> gq.GGUFWeight:
    """[n, k] random blocks of type `name` on the GPU: random quant bytes, float16 fields in +-0.02."""
    qtype = TYPE_IDS[name]
    qk, nbytes = gq._BLOCK[qtype]
    raw = torch.randint(0, 256, (n, k // qk, nbytes), dtype=torch.uint8, device="cuda", generator=gen)
    for off in _F16[name]:
        f = ((torch.rand(n, k // qk, device="cuda", generator=gen) - 0.5) * 0.04).half()
        raw[:, :, off : off + 2] = f.view(torch.uint8).view(n, k // qk, 2)
    return gq.GGUFWeight(qtype, raw.view(n, -1), n, k)


def gemv_bench(name: str, bw: float) -> dict[str, Any]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows: dict[str, Any] = {}
    for shape, (n, k) in SHAPES.items():
        raw = random_packed(name, n, k, gen)
        w = gt.prepare(raw)
        x = torch.randn(1, k, device="cuda", generator=gen).bfloat16()
        ref = x.float() @ gt.dequantize(raw).t()
        out = gq.gguf_matmul(x, [w])
        err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        if not err <= 2e-2:
            raise AssertionError(f"{name} {shape}: relative error {err:.3g}")
        del ref, raw
        ms = do_bench_cudagraph(lambda x=x, w=w: gq.gguf_matmul(x, [w]), rep=50)
        floor_ms = w.nbytes / bw * 1e3
        rows[shape] = dict(ms=ms, floor_ms=floor_ms, x_floor=ms / floor_ms, bytes=w.nbytes, rel_err=err)
        print(
            f"{name} {shape:8s} {ms * 1e3:8.1f} us  floor {floor_ms * 1e3:8.1f} us  {ms / floor_ms:.2f}x  err {err:.1e}"
        )
        del w
    layer = [s for s in SHAPES if s != "lm_head"]
    ms = sum(rows[s]["ms"] for s in layer)
    fl = sum(rows[s]["floor_ms"] for s in layer)
    rows["layer_sum"] = dict(ms=ms, floor_ms=fl, x_floor=ms / fl)
    print(f"{name} layer (qkv+o+gate_up+down): {ms * 1e3:.1f} us = {ms / fl:.2f}x its floor")
    torch.cuda.empty_cache()
    return rows


# Decode-GEMV tiles (BN, BK, warps) of the int8-activation (IDP4A) kernel, which the sweep's bf16 activations
# take for every type it times. History (session 41, NOTES): tiles of 32-256 rows, with and without a prefetch
# of the next step (since removed), were latency-bound (1.7-3x the floor whatever the split): a program waits
# out the memory latency each step, so the bytes in flight per SM (programs resident x tile bytes) set the
# speed, and the smallest tile tried, (16, 512, 2), won 12 of 15 shapes. Going down to a row a program (the
# bf16 row GEMV's shape: whole rows, no split-K), (2, 1024, 2) / (4, 1024, 2) / (1, 2048, 2) won; these are
# one and two warps around those.
_TILES = [(1, 1024, 1), (1, 2048, 2), (2, 1024, 2), (2, 2048, 4), (4, 1024, 2), (4, 512, 1), (8, 512, 2)]


def sweep_configs(qtype: int, n: int, k: int, sms: int) -> list[gt.GemvConfig]:
    """Each tile with split-K 1 and the splits that give ~4, 8 and 16 programs per SM (deduplicated), plus
    the current default (`gemv_config`)."""
    out: list[gt.GemvConfig] = []
    for bn, bk, nw in _TILES:
        blocks, steps = -(-n // bn), -(-k // bk)
        splits = {1} | {max(1, min(steps, -(-per * sms // blocks))) for per in (4, 8, 16)}
        out += [gt.GemvConfig(bn, bk, nw, 1, s) for s in sorted(splits)]
    default = gt.gemv_config(qtype, 1, n, k, gt.int8_activations(qtype, torch.bfloat16))
    if default.split == 0:  # as the launcher resolves it
        bk = max(64, min(default.bk, 1 << (k - 1).bit_length()))
        default = default._replace(split=gt._auto_split(1, -(-n // default.bn), -(-k // bk), sms))
    return out + ([default] if default not in out else [])


def load_tuned(path: str) -> None:
    """`gguf_triton.TUNED` from a `--sweep` JSON: the best launch per (type, shape), for this process."""
    with open(path) as f:
        sw = json.load(f)["sweep"]
    for name, shapes in sw.items():
        for r in shapes.values():
            gt.TUNED[(name, r["n"], r["k"])] = gt.GemvConfig(*r["best"]["config"])
    print(f"TUNED from {path}: {len(gt.TUNED)} entries")


def sweep(name: str, bw: float) -> dict[str, Any]:
    """Time `sweep_configs` for every shape of `name` (M = 1, bf16); the best per shape."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    res: dict[str, Any] = {}
    for shape, (n, k) in SHAPES.items():
        raw = random_packed(name, n, k, gen)
        w = gt.prepare(raw)
        x = torch.randn(1, k, device="cuda", generator=gen).bfloat16()
        ref = (x.float() @ gt.dequantize(raw).t()).view(-1)
        scale = ref.abs().max().item()
        del raw
        floor_ms = w.nbytes / bw * 1e3
        out = torch.empty(1, n, dtype=x.dtype, device="cuda")
        rows = []
        for cfg in sweep_configs(w.qtype, n, k, sms):
            out.zero_()
            gt.gguf_gemv_triton(x, w, out, sms, cfg)
            err = ((out.float().view(-1) - ref).abs().max() / scale).item()
            if not err <= 2e-2:
                raise AssertionError(f"{name} {shape} {cfg}: relative error {err:.3g}")
            ms = do_bench_cudagraph(lambda c=cfg, x=x, w=w, o=out: gt.gguf_gemv_triton(x, w, o, sms, c), rep=20)
            rows.append(dict(config=list(cfg), ms=ms, x_floor=ms / floor_ms, rel_err=err))
            print(f"{name} {shape:8s} {str(tuple(cfg)):24s} {ms * 1e3:8.1f} us  {ms / floor_ms:5.2f}x  err {err:.1e}")
        best = min(rows, key=lambda r: r["ms"])
        res[shape] = dict(n=n, k=k, floor_ms=floor_ms, candidates=rows, best=best)
        print(f"{name} {shape:8s} BEST {tuple(best['config'])} {best['ms'] * 1e3:.1f} us = {best['x_floor']:.2f}x")
        del w, ref
        torch.cuda.empty_cache()
    return res


def profile_w3(llm: Any) -> dict[str, Any]:
    """One 64-token W3 request under the workers' torch profiler: its decode steps' span, busy time and kernels."""
    import sys

    from pagedllm import SamplingParams, TokensPrompt

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from dp_scaling import graph_steps  # type: ignore[import-not-found]

    prompt = [TokensPrompt(prompt_token_ids=list(range(100, 228)))]
    llm.reset_prefix_cache()
    llm.start_profile()
    llm.generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, detokenize=False), use_tqdm=False
    )
    prof: dict[str, Any] = graph_steps(llm.stop_profile()[0], top=14)
    if not prof["decode_graphs"]:
        print("  no decode graphs in the profile")
        return prof
    print(f"  decode step: span {prof['decode_span_ms_median']:.3f} ms, busy {prof['decode_busy_ms_median']:.3f} ms, "
          f"{prof['kernels_per_decode_graph']} kernels")  # fmt: skip
    if prof["decode_gap_ms_median"] is not None:
        print(f"  between steps: {prof['decode_gap_ms_median'] * 1e3:.1f} us (median), of which per gap: "
              + ", ".join(f"{n} {ms * 1e3:.1f} us" for n, ms in prof["decode_gap_work_ms_per_gap"]))  # fmt: skip
    crit = dict(prof["decode_critical_ms_per_step"])
    for kname, ms in prof["decode_top_kernels_ms_per_step"]:
        print(f"    {ms * 1e3:8.1f} us/step ({crit.get(kname, 0.0) * 1e3:7.1f} on the critical path)  {kname}")
    print("  critical path per launch shape (kernel, grid):")
    for key, ms in prof["decode_critical_ms_per_launch_shape"]:
        print(f"    {ms * 1e3:8.1f} us/step  {key}")
    return prof


def w3(llm: Any, reps: int) -> dict[str, Any]:
    """W3's ms per output token (benchmarks/workloads, pagedllm bench latency's method) and its greedy tokens
    (to compare two trees' kernels on the same random weights)."""
    from pagedllm import SamplingParams, TokensPrompt

    rng = random.Random(3)
    prompt = [TokensPrompt(prompt_token_ids=[rng.randint(0, 10000) for _ in range(128)])]

    tokens: list[int] = []

    def run(n: int) -> float:
        llm.reset_prefix_cache()
        sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
        t = time.perf_counter()
        out = llm.generate(prompt, sp, use_tqdm=False)
        dt = time.perf_counter() - t
        tokens[:] = out[0].outputs[0].token_ids
        return dt

    for _ in range(2):
        run(256)
    full = statistics.median(run(256) for _ in range(reps))
    greedy = list(tokens)
    one = statistics.median(run(1) for _ in range(reps))
    # (the 1-token request: the 128-token prefill and its token, offline; the prefill GEMMs' figure)
    return dict(ms_per_token=(full - one) / 255 * 1e3, tokens=greedy, first_token_ms=one * 1e3)


def recapture_decode_graphs(runner: Any) -> None:
    """The decode CUDA graphs again (a launch setting read at capture changed); W3's other graphs (its
    128-token prefill) take no decode GEMV."""
    from pagedllm.utils import cdiv
    from pagedllm.worker.cuda_graph import CudaGraphRunner

    runner.cuda_graphs = None
    torch.cuda.empty_cache()
    runner.cuda_graphs = CudaGraphRunner(
        runner.model, runner.kv_cache_config.groups, runner.builders, runner.max_num_reqs,
        cdiv(runner.max_model_len, runner.block_size), runner.max_model_len, runner.device,
    )  # fmt: skip
    runner.cuda_graphs.capture()


def w3_with(
    llm: Any, runner: Any, model: torch.nn.Module, setting: str, reps: int, profile: bool = False
) -> dict[str, Any]:
    """W3 with settings changed, several joined by commas: environment variables (NAME=VALUE) and decode-GEMV
    launches (TUNED:TYPE:NxK=BN/BK/WARPS/STAGES/SPLIT, a `gguf_triton.TUNED` entry); the producers' twins
    linked again and the decode graphs captured again (both read settings), the old values restored after
    (linked and captured again too)."""
    pairs = [part.partition("=")[::2] for part in setting.split(",")]
    env: dict[str, str | None] = {key: v for key, v in pairs if not key.startswith("TUNED:")}
    tuned: dict[tuple[str, int, int], gt.GemvConfig | None] = {}
    for key, v in pairs:
        if key.startswith("TUNED:"):
            _, qtype, shape = key.split(":")
            n, k = (int(x) for x in shape.split("x"))
            tuned[(qtype, n, k)] = gt.GemvConfig(*(int(x) for x in v.split("/")))
    old_env = {key: os.environ.get(key) for key in env}
    old_tuned = {launch: gt.TUNED.get(launch) for launch in tuned}

    def apply(values: dict[str, str | None], configs: dict[tuple[str, int, int], gt.GemvConfig | None]) -> None:
        for key, value in values.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        for launch, c in configs.items():
            if c is None:
                gt.TUNED.pop(launch, None)
            else:
                gt.TUNED[launch] = c
        triton_utils._pdl_kwargs.cache_clear()  # (PAGEDLLM_PDL* are read once per kernel name)
        triton_utils._pdl_switches.cache_clear()
        act_twin.link_producers(model)
        recapture_decode_graphs(runner)

    apply(env, tuned)
    try:
        r = w3(llm, reps)
        if profile:
            r["profile"] = profile_w3(llm)
        return r
    finally:
        apply(old_env, old_tuned)


def applies(setting: str, qtype: str) -> bool:
    """Whether an --ab setting changes anything for `qtype`: it names an environment variable or one of that
    type's launches (another type's TUNED entries alone change nothing)."""
    keys = [part.partition("=")[0] for part in setting.split(",")]
    if qtype == "bf16":
        return any(not k.startswith(("TUNED:", "PAGEDLLM_GGUF_")) for k in keys)
    return any(not k.startswith("TUNED:") or k.split(":")[1] == qtype for k in keys)


def same_prefix(a: list[int], b: list[int]) -> int:
    """Greedy tokens two runs share before their first difference."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def swap_to_gguf(model: torch.nn.Module, name: str, gen: torch.Generator) -> int:
    """Every linear layer and the LM head get random packed `name` weights (dense weights dropped);
    returns the packed bytes."""
    from pagedllm.model_executor.layers.linear import LinearBase

    total = 0
    for mod in model.modules():
        if isinstance(mod, LinearBase):
            qm = mod.quant_method
            n, k = (
                (sum(p.rows for p in qm.parts), qm.parts[0].cols)
                if isinstance(qm, gq.GGUFLinearMethod)
                else tuple(mod.weight.shape)
            )
            del qm
            gq.install(mod, [])  # drops the old weights before the new ones are made
            w: gq.GGUFWeight = gt.prepare(random_packed(name, n, k, gen))
            gq.install(mod, [w])
            total += w.nbytes
    head: Any = model.lm_head
    parts = getattr(head, "gguf_weight", None)
    n, k = (parts[0].rows, parts[0].cols) if parts else tuple(head.weight.shape)
    head.gguf_weight = None
    head.weight.data = torch.empty(0, dtype=head.weight.dtype, device=head.weight.device)
    torch.cuda.empty_cache()
    w = gt.prepare(random_packed(name, n, k, gen))
    head.gguf_weight = [w]
    torch.cuda.empty_cache()
    return total + w.nbytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", required=True)
    p.add_argument("--types", nargs="+", default=["Q4_1", "Q8_0", "Q4_K"], choices=list(TYPE_IDS))
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--skip-w3", action="store_true")
    p.add_argument("--skip-gemv", action="store_true", help="W3 only (2.)")
    p.add_argument("--sweep", action="store_true", help="time the decode-GEMV launch candidates only (3.)")
    p.add_argument("--profile", action="store_true", help="W3's decode step per kernel, per model (2.)")
    p.add_argument("--tuned", help="a --sweep JSON whose best launches replace gguf_triton.TUNED")
    p.add_argument("--profile-ab", action="store_true", help="profile each --ab run of the packed types too")
    p.add_argument("--ab", nargs="+", metavar="NAME=VALUE", help="W3 of each type again under each setting")
    args = p.parse_args()
    if args.tuned:
        load_tuned(args.tuned)
    bw = floors.copy_bandwidth_gbps() * 1e9
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "copy_GBps": bw / 1e9, "gemv": {}, "w3": {}}
    print(f"{result['device']}: copy {bw / 1e9:.0f} GB/s")
    if args.sweep:
        result["sweep"] = {name: sweep(name, bw) for name in args.types}
        print("# gguf_triton.TUNED entries (best per shape):")
        for name, shapes in result["sweep"].items():
            for r in shapes.values():
                print(f"    ({name!r}, {r['n']}, {r['k']}): GemvConfig{tuple(r['best']['config'])},")
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        return
    for name in [] if args.skip_gemv else args.types:
        result["gemv"][name] = gemv_bench(name, bw)
    if not args.skip_w3:
        from pagedllm import LLM

        prof_dir = {"profiler": "torch", "torch_profiler_dir": f"/tmp/gguf_gpu_profile_{os.getpid()}"}
        llm = LLM(MODEL, load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True, max_model_len=512,
                  max_num_seqs=4, kv_cache_memory_bytes=2 << 30,
                  profiler_config=prof_dir if args.profile else None)  # fmt: skip
        runner = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner
        model = runner.model
        dense_bytes = floors.weight_read_bytes(model)
        r = w3(llm, args.reps)
        ms, fl = r["ms_per_token"], dense_bytes / bw * 1e3
        result["w3"]["bf16"] = dict(r, bytes_per_token=dense_bytes, floor_ms=fl, x_floor=ms / fl)
        print(f"W3 bf16: {ms:.3f} ms/token, floor {fl:.3f} ms, {ms / fl:.2f}x; "
              f"first token {r['first_token_ms']:.1f} ms")  # fmt: skip
        if args.profile:
            result["w3"]["bf16"]["profile"] = profile_w3(llm)
        for setting in args.ab or []:
            if applies(setting, "bf16"):
                r = w3_with(llm, runner, model, setting, args.reps)
                result["w3"][f"bf16@{setting}"] = dict(r, floor_ms=fl, x_floor=r["ms_per_token"] / fl)
                print(f"W3 bf16 with {setting}: {r['ms_per_token']:.3f} ms/token, {r['ms_per_token'] / fl:.2f}x")
        gen = torch.Generator(device="cuda").manual_seed(1)
        for name in args.types:
            runner.cuda_graphs = None
            torch.cuda.empty_cache()
            packed = swap_to_gguf(model, name, gen)
            linked = act_twin.link_producers(model)  # as a GGUF model's load does (worker/cuda_rewrites.py)
            runner.capture_cuda_graphs()  # the old graphs ran the dense weights
            nbytes = packed + floors.weight_read_bytes(model)  # + norms (the dense parameters left)
            r = w3(llm, args.reps)
            ms, fl = r["ms_per_token"], nbytes / bw * 1e3
            result["w3"][name] = dict(r, bytes_per_token=nbytes, floor_ms=fl, x_floor=ms / fl)
            print(f"W3 {name}: {ms:.3f} ms/token, floor {fl:.3f} ms ({nbytes / 1e9:.2f} GB), {ms / fl:.2f}x, "
                  f"{linked} producers writing q8 twins; first token {r['first_token_ms']:.1f} ms")  # fmt: skip
            if args.profile:
                result["w3"][name]["profile"] = profile_w3(llm)
            for setting in args.ab or []:
                if not applies(setting, name):
                    continue
                r = w3_with(llm, runner, model, setting, args.reps, profile=args.profile_ab)
                ms = r["ms_per_token"]
                result["w3"][f"{name}@{setting}"] = dict(r, floor_ms=fl, x_floor=ms / fl)
                same = same_prefix(r["tokens"], result["w3"][name]["tokens"])
                print(f"W3 {name} with {setting}: {ms:.3f} ms/token, {ms / fl:.2f}x; first {same} of "
                      f"{len(r['tokens'])} greedy tokens as without")  # fmt: skip
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
