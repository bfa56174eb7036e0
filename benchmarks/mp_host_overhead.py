"""Host time per engine step through the in-process (uni) vs the multi-process (mp) executor, with the
model's forward replaced by a no-op in the worker (wherever it runs; CPU only): what the mp executor's per-step
messages cost (issue 24, acceptance 5). W1-like: 256 running decodes, Qwen3-0.6B shape, one layer.

    PYTHONPATH=. python benchmarks/mp_host_overhead.py [--steps 300] [--async-scheduling] [--profile DIR]

Alternates uni, mp, uni, mp (--pairs). --profile DIR writes cProfile stats of the engine core's process
and of the worker (mp) for the last pair to DIR (`python -m pstats DIR/mp_worker.prof`).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import statistics
import time
from typing import Any

import torch

VOCAB = 1024


def _noop_worker(worker: Any, num_reqs: int) -> None:
    """Replace the worker's model forward and logits by no-ops (runs in the worker's process)."""
    runner = worker.model_runner
    hidden = runner.model.config.hidden_size
    logits = torch.randn(num_reqs, VOCAB)
    runner.model.forward = lambda input_ids, positions, *a, **k: torch.zeros(input_ids.shape[0], hidden)
    runner.model.compute_logits = lambda h: logits[: h.shape[0]]


def _profile_worker(worker: Any, action: str, path: str = "") -> None:
    if action == "start":
        worker._bench_prof = cProfile.Profile()
        worker._bench_prof.enable()
    else:
        worker._bench_prof.disable()
        worker._bench_prof.dump_stats(path)


def run(backend: str, args: argparse.Namespace, profile_dir: str | None) -> float:
    from pagedllm import LLM, SamplingParams, TokensPrompt
    from pagedllm.benchmarks.workloads import load_workloads_module

    cfg_dir = load_workloads_module().MODELS["qwen3-0.6b"]
    llm = LLM(
        cfg_dir,
        load_format="dummy",
        skip_tokenizer_init=True,
        device="cpu",  # (the no-op forward makes host tensors: a CPU benchmark)
        dtype="float32",
        max_model_len=2048,
        kv_cache_memory_bytes=1 << 30,
        hf_overrides={"num_hidden_layers": 1},
        max_num_seqs=1024,
        max_num_batched_tokens=16384,
        distributed_executor_backend=backend,
        async_scheduling=args.async_scheduling,
    )
    try:
        n = args.num_reqs
        llm.collective_rpc(lambda w: _noop_worker(w, n))
        engine = llm.llm_engine
        sp = SamplingParams(temperature=0.6, max_tokens=args.steps + 50, ignore_eos=True, detokenize=False)
        for i in range(n):
            engine.add_request(str(i), TokensPrompt(prompt_token_ids=list(range(1, 100))), sp)
        sched = engine.engine_core.engine_core.scheduler
        while len(sched.running) < n or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running):
            engine.step()
        for _ in range(5):
            engine.step()
        prof = cProfile.Profile() if profile_dir else None
        if prof is not None:
            if backend == "mp":
                llm.collective_rpc(_profile_worker, args=("start",))
            prof.enable()
        per_step = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            engine.step()
            per_step.append(time.perf_counter() - t0)
        if prof is not None and profile_dir:
            prof.disable()
            prof.dump_stats(os.path.join(profile_dir, f"{backend}_core.prof"))
            if backend == "mp":
                llm.collective_rpc(_profile_worker, args=("stop", os.path.join(profile_dir, "mp_worker.prof")))
        med = statistics.median(per_step) * 1e3
        mean = statistics.fmean(per_step) * 1e3
        print(f"{backend}: host time per step, {n} decodes: median {med:.3f} ms, mean {mean:.3f} ms", flush=True)
        return med
    finally:
        llm.llm_engine.engine_core.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-reqs", type=int, default=256)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--async-scheduling", action="store_true")
    ap.add_argument("--profile", metavar="DIR")
    args = ap.parse_args()
    os.environ.setdefault("PAGEDLLM_CPU_THREADS", "1")  # the same torch threads in both (host time, not GEMMs)
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    res: dict[str, list[float]] = {"uni": [], "mp": []}
    for p in range(args.pairs):
        for backend in ("uni", "mp"):
            last = p == args.pairs - 1
            res[backend].append(run(backend, args, args.profile if last else None))
    uni, mp = statistics.median(res["uni"]), statistics.median(res["mp"])
    print(f"median of medians: uni {uni:.3f} ms, mp {mp:.3f} ms, mp - uni {mp - uni:+.3f} ms per step")


if __name__ == "__main__":
    main()
