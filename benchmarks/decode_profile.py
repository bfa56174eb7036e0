"""Where a small-batch decode step's time goes (W3's question), on the GPU.

    PYTHONPATH=. python3 benchmarks/decode_profile.py [--model benchmarks/workloads/llama-3.1-8b] [--batch 1]
        [--quantization fp8]   (or --model benchmarks/workloads/llama-3.1-8b-awq)

In one process: the copy-bandwidth floor; every linear layer of the model run as the decode step runs
it (M = batch rows, all layers in order, replayed as one CUDA graph so L2 never holds the next weight)
under cuBLAS, cuBLASLt and the engine's batch-1 row GEMV (`triton_gemv`), against bytes / copy bandwidth;
then the engine's own decode step (CUDA graph, synchronous scheduling)
timed over many steps, and a torch.profiler trace of a few steps grouped by kernel name. The gap between
the step's wall time and the sum of its kernels is launch/idle time inside and between graph replays.
Writes JSON to --out and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import defaultdict

import torch

from pagedllm.benchmarks import floors
from pagedllm.model_executor.layers import triton_gemv


def _graph_time_ms(fn, reps: int = 5) -> float:
    import triton.testing as tt

    fn()
    torch.cuda.synchronize()
    return statistics.median([tt.do_bench_cudagraph(fn, rep=200, return_mode="median") for _ in range(reps)])


# (BLOCK_N, BLOCK_K, num_warps, num_stages) tried for triton_gemv.row_gemv at batch 1
ROW_GEMV_SWEEP = [
    (1, 2048, 4, 1),
    (2, 1024, 4, 1),
    (2, 2048, 8, 1),
    (4, 512, 4, 1),
    (4, 1024, 8, 1),
    (4, 2048, 8, 1),
    (8, 512, 4, 1),
    (8, 1024, 8, 1),
    (16, 256, 4, 1),
    (4, 1024, 4, 3),
    (8, 512, 4, 3),
    (2, 512, 2, 1),
]


def linear_table(model: torch.nn.Module, batch: int, copy_gbs: float) -> list[dict]:
    """Per projection kind (last name part): all layers' weights in order, one graph; cuBLAS, cuBLASLt
    (torch.backends.cuda.preferred_blas_library) and the engine's small-batch Triton GEMV."""
    kinds: dict[str, list[torch.Tensor]] = defaultdict(list)
    for name, mod in model.named_modules():
        w = getattr(mod, "weight", None)
        if isinstance(w, torch.Tensor) and w.dim() == 2 and "embed" not in name and w.is_cuda:
            kinds[name.rsplit(".", 1)[-1]].append(w)
    rows = []
    default_lib = torch.backends.cuda.preferred_blas_library()
    for kind, ws in kinds.items():
        x = torch.randn(batch, ws[0].shape[1], dtype=ws[0].dtype, device="cuda")

        def run(ws=ws, x=x) -> None:
            for w in ws:
                torch.nn.functional.linear(x, w)

        times = {}
        for lib in ("cublas", "cublaslt"):
            torch.backends.cuda.preferred_blas_library(lib)
            times[lib] = _graph_time_ms(run)
        torch.backends.cuda.preferred_blas_library(default_lib)
        fp32_out_ms = None
        if kind == "lm_head":  # the engine's LM head on CUDA writes float32 logits (PAGEDLLM_FP32_LOGITS)
            fp32_out_ms = _graph_time_ms(lambda ws=ws, x=x: [torch.mm(x, w.t(), out_dtype=torch.float32) for w in ws])
        nbytes = sum(w.numel() * w.element_size() for w in ws)
        floor = nbytes / (copy_gbs * 1e9) * 1e3
        row_gemv: dict[str, float] = {}
        if triton_gemv.HAS_TRITON and x.shape[0] == 1 and kind != "lm_head":  # PAGEDLLM_ROW_GEMV's kernel
            for cfg in [None, *ROW_GEMV_SWEEP]:
                name = "default" if cfg is None else ",".join(map(str, cfg))
                try:
                    row_gemv[name] = _graph_time_ms(
                        lambda ws=ws, x=x, cfg=cfg: [triton_gemv.row_gemv(x, w, config=cfg) for w in ws], reps=3
                    )
                except Exception as e:  # an out-of-resources config: report, go on
                    print(f"row_gemv {kind} {name}: {type(e).__name__}: {str(e)[:120]}")
            best = min(row_gemv, key=row_gemv.get)
            print(
                f"row_gemv {kind} {tuple(ws[0].shape)}: cuBLAS {times['cublas']:.3f} ms, floor {floor:.3f}; "
                + ", ".join(f"{k} {v:.3f}" for k, v in row_gemv.items())
                + f"; best {best}",
                flush=True,
            )
        ms = times["cublas"]
        rows.append(
            {
                "kind": kind,
                "n": len(ws),
                "shape": list(ws[0].shape),
                "ms": ms,
                "floor_ms": floor,
                "GBps": nbytes / (ms * 1e-3) / 1e9,
                "x_floor": ms / floor,
                "cublaslt_ms": times["cublaslt"],
                "fp32_out_ms": fp32_out_ms,
                "row_gemv_ms": row_gemv,
            }
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="benchmarks/workloads/llama-3.1-8b")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--profile-steps", type=int, default=10)
    p.add_argument("--quantization", default=None, help="e.g. fp8 (the per-linear table is then skipped)")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "decode_profile.json"))
    args = p.parse_args()

    from torch.profiler import ProfilerActivity, profile

    from pagedllm import LLM, SamplingParams, TokensPrompt

    copy_gbs = floors.copy_bandwidth_gbps()
    llm = LLM(
        model=args.model,
        load_format="dummy",
        skip_tokenizer_init=True,
        max_model_len=1024,
        async_scheduling=False,
        quantization=args.quantization,
    )
    engine = llm.llm_engine
    runner = engine.engine_core.engine_core.executor.worker.model_runner
    model = runner.model
    quantized = args.quantization is not None or any(not p.is_floating_point() for p in model.parameters())
    lin = [] if quantized else linear_table(model, args.batch, copy_gbs)  # the table times bf16 weights only
    weight_bytes = floors.weight_read_bytes(model)

    n_out = args.steps + args.profile_steps + 20
    for i in range(args.batch):
        engine.add_request(
            str(i),
            TokensPrompt(prompt_token_ids=list(range(100, 100 + args.input_len))),
            SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True, detokenize=False),
        )
    for _ in range(10):  # prefill + a few decodes
        engine.step()
    torch.cuda.synchronize()
    walls = []
    for _ in range(args.steps):
        t = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t)
    step_ms = statistics.median(walls) * 1e3

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.profile_steps):
            engine.step()
        torch.cuda.synchronize()
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time_total > 0:
            rec = by_name[ev.name[:90]]
            rec[0] += 1
            rec[1] += ev.device_time_total
    kernels = sorted(
        (
            {"name": k, "calls_per_step": c / args.profile_steps, "us_per_step": us / args.profile_steps}
            for k, (c, us) in by_name.items()
        ),
        key=lambda r: -r["us_per_step"],
    )
    kernel_ms = sum(r["us_per_step"] for r in kernels) / 1e3
    n_kernels = sum(r["calls_per_step"] for r in kernels)
    floor_ms = weight_bytes / (copy_gbs * 1e9) * 1e3
    result = {
        "device": torch.cuda.get_device_name(),
        "copy_GBps": copy_gbs,
        "weight_bytes": weight_bytes,
        "weight_floor_ms": floor_ms,
        "step_ms": step_ms,
        "kernel_ms_per_step": kernel_ms,
        "kernels_per_step": n_kernels,
        "linears": lin,
        "kernels": kernels[:40],
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)

    print(f"\n{'kernel':90s} {'calls':>6s} {'us/step':>9s}")
    for r in kernels[:25]:
        print(f"{r['name']:90s} {r['calls_per_step']:6.1f} {r['us_per_step']:9.1f}")
    print(f"\n{'linear':14s} {'n':>3s} {'shape':>14s} {'cublas':>7s} {'floor':>7s} {'GB/s':>6s} {'x':>5s} {'lt':>7s}")
    for r in lin:
        print(
            f"{r['kind']:14s} {r['n']:3d} {str(tuple(r['shape'])):>14s} {r['ms']:7.3f} {r['floor_ms']:7.3f} "
            f"{r['GBps']:6.0f} {r['x_floor']:5.2f} {r['cublaslt_ms']:7.3f}"
            + (f"; float32 out {r['fp32_out_ms']:.3f}" if r["fp32_out_ms"] else "")
        )
    lin_ms = sum(r["ms"] for r in lin)
    print(
        f"\n{result['device']}: copy {copy_gbs:.0f} GB/s; weights {weight_bytes / 1e9:.2f} GB -> floor "
        f"{floor_ms:.3f} ms; linears alone {lin_ms:.3f} ms ({lin_ms / floor_ms:.3f}x); decode step "
        f"{step_ms:.3f} ms ({step_ms / floor_ms:.3f}x), kernels {kernel_ms:.3f} ms in {n_kernels:.0f} launches"
    )


if __name__ == "__main__":
    main()
