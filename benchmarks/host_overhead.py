"""Host time per engine step (scheduling, input preparation, sampling bookkeeping, output processing)
with the model's GPU work replaced by a no-op: W1-like, 256 running decodes, Qwen3-0.6B shape config.

    python benchmarks/host_overhead.py [--steps 200] [--profile] [--device cuda] [--json PATH]

--device cuda runs the same no-op model through the engine on the GPU, sampling on the GPU and, with the GPU
default of async scheduling, waiting on each step's event as the engine does. The no-op forward is installed
on the model class before the engine starts, so the decode CUDA graphs capture it and each step pays the
graph path's host work (persistent-buffer copies, replay) as a served 256-decode step does; `--enforce-eager`
runs it eager instead (the GPU attention backend's metadata built every step).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-reqs", type=int, default=256)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument(
        "--final-only",
        action="store_true",
        help="FINAL_ONLY outputs, as offline LLM.generate (and bench throughput) asks",
    )
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--json", metavar="PATH", help="write the per-step mean and median (ms) to PATH")
    ap.add_argument("--enforce-eager", action="store_true", help="with --device cuda: no CUDA graphs")
    ap.add_argument(
        "--phases",
        action="store_true",
        help="also time the step's phases (schedule, model runner, update_from_output, outputs)",
    )
    args = ap.parse_args()
    on_gpu = args.device == "cuda"
    # CPU: float32, the engine's defaults (the figures so far). CUDA: bfloat16 as served (see above).
    dev_kwargs = dict(dtype="bfloat16", enforce_eager=args.enforce_eager) if on_gpu else dict(dtype="float32")
    from pagedllm import LLM, SamplingParams, TokensPrompt
    from pagedllm.benchmarks.workloads import load_workloads_module

    if on_gpu and not args.enforce_eager:
        # Before the engine starts: the profiling run, the warm-up and the captured graphs all run the no-op.
        from pagedllm.model_executor.models.qwen3 import Qwen3ForCausalLM

        def class_noop_forward(self: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return torch.zeros(
                input_ids.shape[0], self.config.hidden_size, device=input_ids.device, dtype=torch.bfloat16
            )

        Qwen3ForCausalLM.forward = class_noop_forward  # type: ignore[method-assign]

    mod = load_workloads_module()
    cfg_dir = mod.MODELS["qwen3-0.6b"]
    llm = LLM(
        cfg_dir,
        load_format="dummy",
        skip_tokenizer_init=True,
        device=args.device,
        **dev_kwargs,
        max_model_len=2048,
        kv_cache_memory_bytes=1 << 30,
        hf_overrides={"num_hidden_layers": 1},
        max_num_seqs=1024,
        max_num_batched_tokens=16384,
    )  # the GPU defaults (vLLM's limits)
    runner = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner
    hidden = runner.model.config.hidden_size if hasattr(runner.model, "config") else 1024
    vocab = int(os.environ.get("HOST_BENCH_VOCAB", "1024"))  # the no-op logits: small, host work dominates

    def noop_forward(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if on_gpu:
            return torch.zeros(input_ids.shape[0], hidden, device=input_ids.device)
        return torch.zeros(input_ids.shape[0], hidden)

    logits = torch.randn(args.num_reqs, vocab, device=args.device)
    runner.model.forward = noop_forward  # type: ignore[method-assign]
    runner.model.compute_logits = lambda h: logits[: h.shape[0]]  # type: ignore[method-assign]
    engine = llm.llm_engine
    sp = SamplingParams(temperature=0.6, max_tokens=args.steps + 50, ignore_eos=True, detokenize=False)
    if args.final_only:
        from pagedllm.sampling_params import RequestOutputKind

        sp.output_kind = RequestOutputKind.FINAL_ONLY
    for i in range(args.num_reqs):
        engine.add_request(str(i), TokensPrompt(prompt_token_ids=list(range(1, 500))), sp)
    # Prefill (chunked: 256 x 499 tokens over several steps), then a few decode steps, so that every timed
    # step is a pure 256-decode step.
    sched = engine.engine_core.engine_core.scheduler
    while len(sched.running) < args.num_reqs or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running):
        engine.step()
    for _ in range(5):
        engine.step()
    phases = _time_phases(engine) if args.phases else None
    prof = cProfile.Profile() if args.profile else None
    if prof:
        prof.enable()
    if on_gpu:
        torch.cuda.synchronize()
    per_step = []
    t = time.perf_counter()
    for _ in range(args.steps):
        t_step = time.perf_counter()
        engine.step()
        per_step.append(time.perf_counter() - t_step)
    if on_gpu:
        torch.cuda.synchronize()
    dt = (time.perf_counter() - t) / args.steps
    if prof:
        prof.disable()
        stats = pstats.Stats(prof).sort_stats(os.environ.get("SORT", "tottime"))  # SORT=cumulative, NSTATS=40
        stats.print_stats(int(os.environ.get("NSTATS", "20")))
    if phases is not None:
        print("phases, ms per step: " + ", ".join(f"{k} {v * 1e3 / args.steps:.3f}" for k, v in phases.items()))
    print(f"host time per step with {args.num_reqs} running decodes (no-op model): {dt * 1e3:.2f} ms")
    if args.json:
        res = {
            "device": args.device,
            "num_reqs": args.num_reqs,
            "steps": args.steps,
            "vocab": vocab,
            "final_only": args.final_only,
            "cuda_graphs": on_gpu and not args.enforce_eager,
            "mean_ms": dt * 1e3,
            "median_ms": statistics.median(per_step) * 1e3,
            "max_ms": max(per_step) * 1e3,
        }
        if phases is not None:
            res["phases_ms"] = {k: v * 1e3 / args.steps for k, v in phases.items()}
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


def _time_phases(engine) -> dict[str, float]:  # noqa: ANN001
    """Wraps the step's phases with timers (instance attributes, so only this engine is affected); returns
    the dict their seconds accumulate in, counted from now."""
    core = engine.engine_core.engine_core
    runner = core.executor.worker.model_runner
    acc: dict[str, float] = {}
    targets = [
        (core.scheduler, "schedule"),
        (runner, "_launch"),
        (runner, "_update_states"),
        (runner.sampling, "build"),
        (runner.sampler, "forward"),
        (runner, "finish_step"),
        (core.scheduler, "update_from_output"),
        (engine.output_processor, "process_outputs"),
    ]
    if runner.cuda_graphs is not None:
        targets.append((runner.cuda_graphs, "run"))
    for obj, name in targets:
        fn = getattr(obj, name)
        acc[name] = 0.0

        def timed(*a, _fn=fn, _name=name, **k):  # noqa: ANN002, ANN003, ANN202
            t0 = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                acc[_name] += time.perf_counter() - t0

        setattr(obj, name, timed)
    return acc


if __name__ == "__main__":
    main()
