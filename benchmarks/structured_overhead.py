"""Structured-output cost: decode step time with N JSON-schema requests vs N free ones, first-token latency
of a request with a new schema vs a plain one, and grammar compile time on its own. Dummy weights of any
model shape (a config directory); the tokenizer is the built-in SmolLM2's unless given.

    python benchmarks/structured_overhead.py [--model CONFIG_DIR] [--device cuda] [--num-reqs 64] [--json PATH]
    # CPU, small shape:
    python benchmarks/structured_overhead.py --model benchmarks/workloads/smollm2-135m

Decode steps are timed only while all N requests are decoding (prefill done, none finished): the schema's
strings have a minimum length so no grammar can end within the timed steps.

Besides each step's wall time, the step loop's own CPU time (`time.thread_time`, `step_cpu_ms_*`) and the
structured code's time on the step loop (`so_*_ms_per_step`: row bookkeeping, token intake, bitmask fill, mask
apply, the scheduler's per-request advance) are reported: on a CPU the forward dominates the step, so the
end-to-end difference hides a ~1 ms cost that these isolate. `--tiny` shrinks the model to one narrow layer, so
the step is mostly host work (as the GPU's batch-64 decode step is); `--quick` skips compile and first-token
timings.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np


def decode_schema(min_len: int) -> dict[str, Any]:
    """A realistic object whose string fields keep every request decoding for the timed steps."""
    return {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 10**6},
            "title": {"type": "string", "minLength": min_len, "maxLength": min_len * 2},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
            "body": {"type": "string", "minLength": min_len},
        },
        "required": ["id", "title", "tags", "body"],
        "additionalProperties": False,
    }


def fresh_schema() -> dict[str, Any]:
    """A schema never seen before (no compile cache can hold it)."""
    key = "k" + uuid.uuid4().hex[:8]
    return {
        "type": "object",
        "properties": {
            key: {"type": "string", "maxLength": 32},
            "n": {"type": "integer", "minimum": 0, "maximum": 100},
            "items": {"type": "array", "items": {"type": "number"}, "maxItems": 4},
        },
        "required": [key, "n"],
    }


class StepLoopTimers:
    """Time spent in the structured-output code on the step loop's thread, by part (seconds, summed).

    Parts do not nest: `intake` (the previous step's tokens into the matchers, async scheduling) and the wait
    for that step's result are taken out of `fill`, and the whole fill out of `apply`."""

    PARTS = ("prepare", "intake", "fill", "apply", "advance", "srv_prepare", "srv_update", "srv_publish")
    """The srv_ parts: the grammar server's mode (`structured_output/remote.py`): the step order (`prepare`, its
    message included), the update's token pass (`begin_update`) and the sampled ids' copy back (`publish_sampled`,
    inside the runner's sampling, not inside `apply`)."""
    CPU = ("apply_incl_fill_cpu", "apply_incl_fill_wall", "advance_cpu", "apply_cuda_cpu", "apply_cuda_wall")
    """The loop thread's CPU time (`time.thread_time`) in the whole apply (fill wait included) and in `advance`,
    against the wall time of the same calls: wall far above CPU is time the loop thread did not run (the GIL
    held by another thread, or descheduled; a blocking wait for the fill counts there too)."""

    INSIDE_APPLY = ("apply_rows", "apply_wait", "apply_launch")
    """The grammar server mode's apply (`link.ServerMask.apply_to`), by call: the rows' places, the flag wait's
    enqueue (with this timer's two CUDA event records), the mask kernel's launch; the mask's upload is the rest."""
    EVERY = ("loop_wait", "flag_wait")
    """Every case: the step loop blocked for a step's sampled ids (the device behind the host: the loop waits
    ~ the step's slack; ~0 when the loop is host-bound), and the device stalled on the grammar server's mask flag
    (CUDA events around the stream wait; the server late)."""

    def __init__(self) -> None:
        self.total = dict.fromkeys(self.PARTS + self.CPU + self.EVERY + self.INSIDE_APPLY, 0.0)
        self._inner = 0.0
        self._wait = 0.0
        self._flag_events: list[tuple[Any, Any]] = []

    def install(self, breakdown: bool = False) -> None:
        """`breakdown`: also the device's stall on the mask flag (two CUDA event records around each flag wait,
        ~20-40 us of host work a structured step on a GPU host: not in the plain A/B) and the apply by call."""
        import pagedllm.worker.model_runner as mr
        from pagedllm.structured_output.manager import GrammarBitmask, StructuredOutputManager

        def timed(part: str, fn: Any, exclude_inner: bool = False, report_inner: bool = False) -> Any:
            def wrapper(*a: Any, **k: Any) -> Any:
                inner0, wait0 = self._inner, self._wait
                cpu = time.thread_time()
                t = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    dt = time.perf_counter() - t
                    if part == "apply":
                        self.total["apply_incl_fill_cpu"] += time.thread_time() - cpu
                        self.total["apply_incl_fill_wall"] += dt
                    elif part == "advance":
                        self.total["advance_cpu"] += time.thread_time() - cpu
                    nested = self._inner - inner0
                    self.total[part] += dt - (nested if exclude_inner else 0.0)
                    if part == "fill":  # the wait for the previous step is no structured cost
                        self.total[part] -= self._wait - wait0
                    self._inner = inner0 + (dt if report_inner else nested)

            return wrapper

        import pagedllm.structured_output.apply as apply_mod

        real_cuda = getattr(apply_mod, "_apply_cuda", None)
        if real_cuda is not None:  # the upload and the launch alone

            def apply_cuda(*a: Any, **k: Any) -> Any:
                cpu, t = time.thread_time(), time.perf_counter()
                try:
                    return real_cuda(*a, **k)
                finally:
                    self.total["apply_cuda_wall"] += time.perf_counter() - t
                    self.total["apply_cuda_cpu"] += time.thread_time() - cpu

            apply_mod._apply_cuda = apply_cuda  # type: ignore[attr-defined]
        so_mgr, gb = StructuredOutputManager, GrammarBitmask
        so_mgr.prepare = timed("prepare", so_mgr.prepare)  # type: ignore[method-assign]
        so_mgr.advance = timed("advance", so_mgr.advance)  # type: ignore[method-assign]
        so_mgr.pre_accept = timed("intake", so_mgr.pre_accept, report_inner=True)  # type: ignore[method-assign]
        gb.narrow = timed("fill", gb.narrow, exclude_inner=True, report_inner=True)  # type: ignore[method-assign]
        mr.apply_grammar_bitmask = timed("apply", mr.apply_grammar_bitmask, exclude_inner=True)  # type: ignore[attr-defined]
        real_chain = so_mgr.chain

        def chain(mgr: Any, so: Any, previous: Any) -> Any:
            from pagedllm.executor.abstract import StepFuture

            def waited() -> Any:
                t = time.perf_counter()
                try:
                    return previous.result()
                finally:
                    self._wait += time.perf_counter() - t

            return real_chain(mgr, so, StepFuture(waited))

        so_mgr.chain = chain  # type: ignore[method-assign]
        from pagedllm.structured_output.link import ServerMask
        from pagedllm.structured_output.remote import ProcessGrammarManager as pgm

        pgm.prepare = timed("srv_prepare", pgm.prepare)  # type: ignore[method-assign]
        pgm.begin_update = timed("srv_update", pgm.begin_update)  # type: ignore[method-assign]
        ServerMask.publish_sampled = timed("srv_publish", ServerMask.publish_sampled)  # type: ignore[method-assign]
        self._install_waits(breakdown)
        if breakdown:
            self._install_apply_parts()
        try:  # the intake on a worker thread (async scheduling): what the step loop spends starting it
            from pagedllm.structured_output.overlap import StepJobs
        except ImportError:
            return
        StepJobs.sampled = timed("intake", StepJobs.sampled)  # type: ignore[method-assign]

    def _install_apply_parts(self) -> None:
        import pagedllm.structured_output.link as link_mod

        def plain_timed(part: str, fn: Any) -> Any:
            def wrapper(*a: Any, **k: Any) -> Any:
                t = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    self.total[part] += time.perf_counter() - t

            return wrapper

        link_mod.ServerLink.rows_for = plain_timed("apply_rows", link_mod.ServerLink.rows_for)  # type: ignore[method-assign]
        link_mod.launch_mask_kernel = plain_timed("apply_launch", link_mod.launch_mask_kernel)  # type: ignore[attr-defined]

    def _install_waits(self, flag_events: bool) -> None:
        from pagedllm.worker.async_output import PendingStep

        real_ids = PendingStep.sampled_ids

        def sampled_ids(step: Any) -> Any:
            t = time.perf_counter()
            try:
                return real_ids(step)
            finally:
                self.total["loop_wait"] += time.perf_counter() - t

        PendingStep.sampled_ids = sampled_ids  # type: ignore[method-assign]
        if not flag_events:
            return
        try:
            from pagedllm.structured_output.host_flags import RegisteredHostMemory
        except ImportError:
            return
        real_wait = RegisteredHostMemory.wait_geq

        def wait_geq(mem: Any, *a: Any, **k: Any) -> None:
            import torch

            t = time.perf_counter()
            before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            before.record()
            real_wait(mem, *a, **k)
            after.record()
            self._flag_events.append((before, after))
            self.total["apply_wait"] += time.perf_counter() - t

        RegisteredHostMemory.wait_geq = wait_geq  # type: ignore[method-assign]

    def snapshot(self) -> dict[str, float]:
        for before, after in self._flag_events:
            after.synchronize()
            self.total["flag_wait"] += before.elapsed_time(after) / 1e3
        self._flag_events.clear()
        return dict(self.total)


def time_decode(
    llm: Any,
    prompts: list[list[int]],
    sp: Any,
    steps: int,
    timers: StepLoopTimers | None = None,
    around: Any = None,
    server_tune: tuple[list[int] | None, float | None] | None = None,
) -> tuple[list[float], int, float, dict[str, float]]:
    """Per-step wall times (s) of `steps` decode steps with every request running; the smallest batch seen;
    the step loop's CPU time over them (s); the structured code's time on the step loop over them (s).
    `server_tune`: the grammar server's CPUs and message polling for these steps (`GrammarClient.tune`)."""
    from pagedllm import TokensPrompt

    engine = llm.llm_engine
    sched = engine.engine_core.engine_core.scheduler
    ids = [f"r{uuid.uuid4().hex[:6]}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, TokensPrompt(prompt_token_ids=p), sp)
    started: set[str] = set()
    while len(started) < len(ids):  # compile (structured), prefill, first tokens
        for out in engine.step():
            if out.outputs and out.outputs[0].token_ids:
                started.add(out.request_id)
    for _ in range(3):
        engine.step()
    if PIN:  # the step loop and the grammar worker on cores of their own (--pin)
        _pin_threads(*PIN)
    times, min_batch = [], len(ids)
    link = getattr(sched.structured, "link", None)
    if link is not None and server_tune is not None:
        link.client.tune(*server_tune)
    srv0 = link.client.request_stats() if link is not None else None
    before = timers.snapshot() if timers is not None else {}
    cpu = time.thread_time()
    with around if around is not None else contextlib.nullcontext():  # (a profiler: the timed steps only)
        for _ in range(steps):
            min_batch = min(min_batch, len(sched.running))
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
    cpu = time.thread_time() - cpu
    parts = {k: v - before[k] for k, v in timers.snapshot().items()} if timers is not None else {}
    srv1 = link.client.request_stats() if link is not None else None
    if srv0 and srv1:  # the grammar server's time over the timed steps, by part
        parts.update({f"server_{k}": v - srv0[k] for k, v in srv1.items() if k != "steps"})
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    return times, min_batch, cpu, parts


def fake_grammar() -> None:
    """--fake-grammar: the structured step without xgrammar's work. The worker's intake only reads the sampled
    ids (no matcher advances) and the fill only sets every bit (no matcher fill); the step loop's part (rows, the
    intake hook, publishing, the mask's upload and apply, the scheduler's checks) runs as usual. Against plain
    decoding this is the loop's own cost; against the real run, what the grammar work on the worker (its GIL
    holds, the waits for it) adds."""
    from pagedllm.structured_output import matchers, overlap

    def run(job: Any, host: Any, event: Any) -> None:
        if event is not None:
            event.synchronize()
        ids = host.tolist()
        job.tokens = [ids[j] for _, j in job.picked]
        job.rejected, job.terminated = [], []

    def fill(bm: Any, ended: Any = None, batch: Any = None) -> Any:
        import torch

        n, words = len(bm.matchers), -(-bm.valid_vocab // 32)
        if isinstance(bm._pin, matchers.PinnedMaskRing):
            mask, bm._slot = bm._pin.take(n, words)
        else:
            mask = torch.empty((n, words), dtype=torch.int32, pin_memory=bool(bm._pin))
        mask.numpy().fill(-1)
        return mask, [i for i, st in enumerate(bm.states or []) if not st.terminated]

    overlap._Intake.run = run  # type: ignore[method-assign]
    matchers.GrammarBitmask._fill = fill  # type: ignore[method-assign]


PIN: tuple[int, int] | None = None
"""--pin LOOP,WORKER: CPUs for the step loop's thread and the grammar worker thread (other threads: the rest)."""


def _pin_threads(loop_cpu: int, worker_cpu: int) -> None:
    import threading

    allowed = os.sched_getaffinity(0) | {loop_cpu, worker_cpu}
    rest = allowed - {loop_cpu, worker_cpu}
    main = threading.main_thread().native_id
    workers = {t.native_id for t in threading.enumerate() if t.name.startswith("grammar-step")}
    for tid in (int(t) for t in os.listdir("/proc/self/task")):
        cpus = {loop_cpu} if tid == main else {worker_cpu} if tid in workers else rest
        with contextlib.suppress(OSError):
            os.sched_setaffinity(tid, cpus)


HOST_RANGES = {
    "pagedllm.engine.llm_engine:LLMEngine.step": "step",
    "pagedllm.engine.core:EngineCore.step": "core_step",
    "pagedllm.engine.output_processor:OutputProcessor.process_outputs": "outputs",
    "pagedllm.core.scheduler:Scheduler.schedule": "schedule",
    "pagedllm.core.scheduler:Scheduler.update_from_output": "update",
    "pagedllm.worker.model_runner:ModelRunner._launch": "launch",
    "pagedllm.worker.model_runner:ModelRunner.complete_launch": "flush",
    "pagedllm.worker.model_runner:ModelRunner._sample": "sample",
    "pagedllm.worker.model_runner:ModelRunner.finish_step": "finish_step",
    "pagedllm.sample.sampler:Sampler.forward": "sampler",
    "pagedllm.structured_output.matchers:GrammarBitmask.narrow": "narrow",
    "xgrammar:apply_token_bitmask_inplace": "xgr_apply",
    "pagedllm.worker.model_runner:apply_grammar_bitmask": "apply",
    "pagedllm.structured_output.apply:_apply_cuda": "apply_cuda",
    "pagedllm.worker.model_runner:ModelRunner._update_states": "update_states",
    "pagedllm.worker.model_runner:ModelRunner._forward": "forward",
    "pagedllm.worker.step_inputs:StepInputBuilder.build": "inputs_build",
    "pagedllm.worker.async_output:InFlightTokens.patch": "in_flight_patch",
    "pagedllm.worker.async_output:AsyncCopier.copy": "copy_out",
    "pagedllm.worker.sampling_batch:SamplingBatch.build": "sampling_build",
    "pagedllm.worker.cuda_graph:CudaGraphRunner.run": "graph_run",
    "pagedllm.worker.prompt_logprobs:PromptLogprobs.gather": "prompt_lp",
    "pagedllm.structured_output.manager:StructuredOutputManager.prepare": "so_prepare",
    "pagedllm.structured_output.manager:StructuredOutputManager.advance": "so_advance",
    "pagedllm.structured_output.overlap:StepJobs.sampled": "so_sampled",
    "pagedllm.structured_output.overlap:StepJobs.chain": "so_chain",
    "pagedllm.structured_output.overlap:StepJobs.publish": "so_publish",
}
"""Functions timed by --profile-host (module:qualname -> range name)."""


def host_profile(llm: Any, prompts: list[list[int]], sp: Any, steps: int) -> dict[str, float]:
    """Mean host ms per decode step in each of HOST_RANGES (nested ranges overlap; "step" is the whole)."""
    import importlib
    import tempfile

    import torch

    patched = []
    for target, label in HOST_RANGES.items():
        mod_name, qual = target.split(":")
        owner: Any = importlib.import_module(mod_name)
        *path, attr = qual.split(".")
        for part in path:
            owner = getattr(owner, part)
        fn = getattr(owner, attr)

        def wrapped(*a: Any, _fn: Any = fn, _label: str = label, **k: Any) -> Any:
            with torch.profiler.record_function(_label):
                return _fn(*a, **k)

        setattr(owner, attr, wrapped)
        patched.append((owner, attr, fn))
    path = os.path.join(tempfile.mkdtemp(prefix="so_host_"), "host.json")
    try:
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        time_decode(llm, prompts, sp, steps, around=prof)
        prof.export_chrome_trace(path)
    finally:
        for owner, attr, fn in patched:
            setattr(owner, attr, fn)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    totals = dict.fromkeys(HOST_RANGES.values(), 0.0)
    for e in events:
        if e.get("name") in totals and "dur" in e:
            totals[e["name"]] += e["dur"]
    return {k: v / 1e3 / steps for k, v in totals.items()}


def first_token_latency(llm: Any, prompt: list[int], make_sp: Any, trials: int) -> float:
    from pagedllm import TokensPrompt

    out = []
    for _ in range(trials):
        t = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=prompt)], make_sp(), use_tqdm=False)
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def main() -> None:
    from pagedllm.benchmarks.workloads import load_workloads_module

    mod = load_workloads_module()
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=mod.MODELS["qwen3-0.6b"], help="config directory (dummy weights)")
    ap.add_argument("--tokenizer", default=None, help="default: the built-in SmolLM2 GGUF's tokenizer")
    ap.add_argument("--hf-overrides", type=json.loads, default=None)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--num-reqs", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--cases", default=None, help="comma-separated decode cases to run (default: all)")
    ap.add_argument("--pyspy", default=None, help="py-spy raw samples (all threads, idle too) of the decode runs")
    ap.add_argument("--switch-interval-us", type=float, default=None, help="sys.setswitchinterval (GIL), us")
    ap.add_argument("--profile", type=int, default=0, help="profile this many decode steps per case (CUDA)")
    ap.add_argument("--profile-host", type=int, default=0, help="host time by function over this many steps")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--tiny", action="store_true", help="one narrow layer: the step is mostly host work")
    ap.add_argument("--quick", action="store_true", help="skip the compile and first-token timings")
    ap.add_argument("--pin", default=None, help="LOOP,WORKER: pin the step loop and the grammar worker threads")
    ap.add_argument("--fake-grammar", action="store_true", help="structured steps without xgrammar's work")
    ap.add_argument(
        "--server-variants",
        default="",
        help="grammar server mode: more structured cases, NAME:CPUS:POLL_US,... (CPUS '8-15' or empty: all; "
        "POLL_US 0: the server blocks for messages), each run with the server so tuned",
    )
    ap.add_argument(
        "--breakdown",
        action="store_true",
        help="the device's stall on the grammar server's flag (CUDA events: adds host work) and the apply by call",
    )
    ap.add_argument("--repeats", type=int, default=1, help="plain / structured / plain runs of the decode steps")
    args = ap.parse_args()
    if args.tiny:
        from pagedllm.benchmarks.workloads import TINY_OVERRIDES

        args.hf_overrides = {**TINY_OVERRIDES, **(args.hf_overrides or {})}
    if args.fake_grammar:
        fake_grammar()
    if args.pin:
        global PIN
        loop_cpu, worker_cpu = (int(v) for v in args.pin.split(","))
        PIN = (loop_cpu, worker_cpu)
    if args.switch_interval_us:
        import sys

        sys.setswitchinterval(args.switch_interval_us / 1e6)

    from pagedllm import LLM, SamplingParams, StructuredOutputsParams
    from pagedllm.structured_output.backend import XgrammarBackend
    from pagedllm.structured_output.config import StructuredOutputsConfig
    from pagedllm.transformers_utils.config import default_model_path
    from pagedllm.transformers_utils.tokenizer import get_tokenizer

    args.tokenizer = args.tokenizer or default_model_path()
    on_gpu = args.device == "cuda"
    llm = LLM(
        args.model,
        tokenizer=args.tokenizer,
        load_format="dummy",
        device=args.device,
        dtype=args.dtype or ("bfloat16" if on_gpu else "float32"),
        hf_overrides=args.hf_overrides,
        max_model_len=2048,
        kv_cache_memory_bytes=(4 << 30) if on_gpu else (1 << 30),
        async_scheduling=args.async_scheduling,
    )
    vocab = llm.llm_engine.model_config.vocab_size
    res: dict[str, Any] = {"model": args.model, "device": args.device, "num_reqs": args.num_reqs, "vocab": vocab}

    # 1. Grammar compile time alone (a fresh backend: no cache), and the one-off vocabulary read.
    tok = get_tokenizer(args.tokenizer)
    t = time.perf_counter()
    backend = XgrammarBackend(tok, vocab, [tok.eos_token_id], StructuredOutputsConfig())
    res["tokenizer_info_ms"] = (time.perf_counter() - t) * 1e3
    if not args.quick:
        compile_ms = []
        for _ in range(args.trials):
            so = StructuredOutputsParams(json=fresh_schema())
            t = time.perf_counter()
            backend.compile(so)
            compile_ms.append((time.perf_counter() - t) * 1e3)
        # The first is cold; the later ones reuse xgrammar's cached masks of the rules they share with it
        # (PAGEDLLM_XGRAMMAR_CACHE_MB=0: every compile is cold).
        res["compile_ms_first"] = compile_ms[0]
        res["compile_ms_median"] = statistics.median(compile_ms[1:] or compile_ms)
        res["compile_ms_trials"] = [round(v, 2) for v in compile_ms]
        t = time.perf_counter()
        backend.compile(StructuredOutputsParams(json=decode_schema(256)))
        res["compile_decode_schema_ms"] = (time.perf_counter() - t) * 1e3

    # 1b. The per-step host fill (xgrammar batch fill) and the device apply alone, N rows inside a JSON string.
    import torch
    import xgrammar as xgr

    from pagedllm.core.scheduler_output import CachedRequestData, SchedulerOutput
    from pagedllm.structured_output.apply import apply_grammar_bitmask
    from pagedllm.structured_output.engine import FILL_THREADS
    from pagedllm.structured_output.manager import GrammarBitmask

    compiled = backend.compile(StructuredOutputsParams(json=decode_schema(256)))
    prefix = tok.encode('{"id": 12, "title": "hello world', add_special_tokens=False)
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(args.num_reqs)]
    for m in matchers:
        for t_id in prefix:
            m.accept_token(t_id)
    batch = xgr.BatchGrammarMatcher(FILL_THREADS)
    fills, applies = [], []
    logits = torch.randn(args.num_reqs, vocab, device=args.device)
    rids = [f"r{i}" for i in range(args.num_reqs)]
    for _ in range(20):
        t = time.perf_counter()
        bm = GrammarBitmask(matchers, vocab, batch, backend.valid_vocab, pin=on_gpu)
        bm.narrow()
        fills.append(time.perf_counter() - t)
        ids = {r: i for i, r in enumerate(rids)}
        so_ = SchedulerOutput([], CachedRequestData(), {}, 0, structured_output_request_ids=ids, grammar_bitmask=bm)
        t = time.perf_counter()
        apply_grammar_bitmask(logits, so_, rids, np.arange(args.num_reqs))
        if on_gpu:
            torch.cuda.synchronize()
        applies.append(time.perf_counter() - t)
    res["fill_ms_median"] = statistics.median(fills) * 1e3
    for threads in (1, 2, 4, 8):  # xgrammar's batch-fill threads (PAGEDLLM_GRAMMAR_FILL_THREADS)
        sweep_batch = xgr.BatchGrammarMatcher(threads)
        ts = []
        for _ in range(20):
            t = time.perf_counter()
            GrammarBitmask(matchers, vocab, sweep_batch, backend.valid_vocab, pin=on_gpu).narrow()
            ts.append(time.perf_counter() - t)
        res[f"fill_ms_threads_{threads}"] = statistics.median(ts) * 1e3
    res["apply_ms_median"] = statistics.median(applies) * 1e3

    # 1c. The matchers' token intake (one sampled token each, inside a JSON string): a Python loop of
    # accept_token + is_terminated (before session 18) against the manager's `pre_accept` (async scheduling).
    from pagedllm.structured_output.manager import StructuredOutputManager, _RequestGrammar

    word = tok.encode(" the", add_special_tokens=False)[0]
    mgr = StructuredOutputManager(StructuredOutputsConfig(), lambda: backend, vocab)
    loop_m = [xgr.GrammarMatcher(compiled) for _ in range(args.num_reqs)]
    for rid, m in zip(rids, loop_m):
        for t_id in prefix:
            m.accept_token(t_id)
        st = _RequestGrammar(None, True)  # type: ignore[arg-type]
        st.matcher = xgr.GrammarMatcher(compiled)
        for t_id in prefix:
            st.matcher.accept_token(t_id)
        mgr.states[rid] = st
    loop_t, mgr_t = [], []
    for _ in range(20):
        t = time.perf_counter()
        for m in loop_m:
            if not m.accept_token(word) or m.is_terminated():
                raise RuntimeError("intake benchmark: token rejected")
        loop_t.append(time.perf_counter() - t)
        t = time.perf_counter()
        mgr.pre_accept(rids, [[word]] * args.num_reqs, {})
        mgr_t.append(time.perf_counter() - t)
    assert not any(st.error or st.terminated for st in mgr.states.values())
    res["intake_ms_loop_median"] = statistics.median(loop_t) * 1e3
    res["intake_ms_manager_median"] = statistics.median(mgr_t) * 1e3
    mgr.shutdown()

    # 2. Decode step time: N free requests vs N constrained by one JSON schema (compiled once, shared).
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, min(vocab, 40000), args.prompt_len).tolist() for _ in range(args.num_reqs)]
    max_tokens = args.steps + 64
    plain = SamplingParams(temperature=0.6, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    so = StructuredOutputsParams(json=decode_schema(4 * max_tokens))
    constrained = plain.clone(structured_outputs=so)
    time_decode(llm, prompts[:8], plain, 5)  # warm-up
    timers = StepLoopTimers()
    timers.install(breakdown=args.breakdown)
    runs: dict[str, list[float]] = {}
    parts: dict[str, dict[str, list[float]]] = {"": {}, "inline_": {}}
    manager = llm.llm_engine.engine_core.engine_core.scheduler.structured
    # structured: as the engine runs (async scheduling: the matchers' intake and the fill on a worker thread);
    # structured_inline: the worker off, both on the step loop (the engine's path before session 18).
    # structured_nodefer: the sampling launched right after the forward (waiting there for the mask's fill)
    # instead of after the engine read the previous step (PAGEDLLM_GRAMMAR_DEFER=0).
    cases: list[tuple[str, Any, bool, dict[str, str]]] = [
        ("plain", plain, True, {}),
        ("structured", constrained, True, {}),
    ]
    tunes: dict[str, tuple[list[int] | None, float | None]] = {}
    if args.server_variants:
        tunes["structured"] = (None, None)  # the defaults
        for item in args.server_variants.split(","):
            vname, cpus, poll_us = item.split(":")
            tunes[f"structured_{vname}"] = (sorted(_cpu_list(cpus)) if cpus else None, float(poll_us))
            cases.append((f"structured_{vname}", constrained, True, {}))
    if hasattr(manager, "step_worker"):
        cases.append(("structured_inline", constrained, False, {}))
    if args.async_scheduling or (args.async_scheduling is None and on_gpu):
        cases.append(("structured_nodefer", constrained, True, {"PAGEDLLM_GRAMMAR_DEFER": "0"}))
    cases.append(("plain_again", plain, True, {}))
    if args.cases:
        keep = set(args.cases.split(",")) | set(tunes)
        cases = [c for c in cases if c[0] in keep]
    spy = _pyspy(args.pyspy) if args.pyspy else contextlib.nullcontext()
    spy.__enter__()
    for _ in range(args.repeats):
        for name, sp, worker, env in cases:
            if hasattr(manager, "step_worker"):
                manager.step_worker = worker
            with _env(**env):
                times, min_batch, cpu, used = time_decode(
                    llm, prompts, sp, args.steps, timers, server_tune=tunes.get(name)
                )
            runs.setdefault(f"step_ms_{name}", []).append(statistics.median(times) * 1e3)
            runs.setdefault(f"step_cpu_ms_{name}", []).append(cpu / args.steps * 1e3)
            for p in StepLoopTimers.EVERY + tuple(k for k in used if k.startswith("server_")):
                runs.setdefault(f"{p}_ms_{name}", []).append(used.get(p, 0.0) / args.steps * 1e3)
            res[f"min_batch_{name}"] = min(min_batch, res.get(f"min_batch_{name}", min_batch))
            if name in ("structured", "structured_inline"):
                for p, v in used.items():
                    parts["inline_" if name.endswith("inline") else ""].setdefault(p, []).append(v / args.steps * 1e3)
    spy.__exit__(None, None, None)
    for key, vals in runs.items():  # per repeat: the median step; over repeats: median (and min)
        res[key] = statistics.median(vals)
        if args.repeats > 1:
            res[key.replace("_ms_", "_ms_min_", 1)] = min(vals)
            res[key + "_runs"] = [round(v, 3) for v in vals]
    for prefix, by_part in parts.items():
        if not by_part:
            continue
        for p, vals in by_part.items():
            res[f"so_{prefix}{p}_ms_per_step"] = statistics.median(vals)
            res[f"so_{prefix}{p}_ms_per_step_runs"] = [round(v, 3) for v in vals]
        res[f"so_{prefix}total_ms_per_step"] = sum(res[f"so_{prefix}{p}_ms_per_step"] for p in StepLoopTimers.PARTS)
    plains = [k for k in ("plain", "plain_again") if f"step_ms_{k}" in res]
    base = statistics.mean(res[f"step_ms_{k}"] for k in plains) if plains else None
    base_cpu = statistics.mean(res[f"step_cpu_ms_{k}"] for k in plains) if plains else None
    for name in [c[0] for c in cases if c[0].startswith("structured")]:
        if f"step_ms_{name}" in res and base is not None and base_cpu is not None:
            res[f"{name}_overhead_pct"] = (res[f"step_ms_{name}"] / base - 1) * 100
            res[f"{name}_cpu_overhead_pct"] = (res[f"step_cpu_ms_{name}"] / base_cpu - 1) * 100

    # 2b. Where the step's time goes on the device (--profile N): N decode steps of each case under the torch
    # profiler; the GPU's busy share of the window (near 100 %: the device is the bottleneck, so host work is
    # hidden; lower: the step waits for the host) and the top kernels.
    if args.profile and on_gpu:
        import tempfile

        from tp_step_profile import summarize

        for name, sp, _, env in cases[:2] + [c for c in cases if c[0] == "structured_nodefer"]:
            path = os.path.join(tempfile.mkdtemp(prefix="so_prof_"), f"{name}.json")
            with _env(**env):
                prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
                time_decode(llm, prompts, sp, args.profile, around=prof)
            prof.export_chrome_trace(path)
            r = summarize(path, top=8)
            res[f"profile_{name}"] = r
            if not r.get("kernels", 1):
                continue
            print(f"profile {name}: span {r['span_ms']:.1f} ms, GPU busy {r['gpu_busy_ms']:.1f} ms "
                  f"({r['gpu_busy_ms'] / r['span_ms']:.0%})")  # fmt: skip
            for kname, ms in r["top_kernels_ms"]:
                print(f"    {ms:9.2f} ms  {kname}")

    # 2c. The step loop's host time by function (--profile-host N): N decode steps per case under the torch
    # profiler (CPU), the engine's functions wrapped in record_function ranges; mean ms per step of each.
    if args.profile_host:
        for name, sp, _, env in cases[:2]:
            with _env(**env):
                res[f"host_{name}"] = host_profile(llm, prompts, sp, args.profile_host)
            print(f"host {name}: " + ", ".join(f"{k} {v:.3f}" for k, v in res[f"host_{name}"].items()))

    # 3. First-token latency on an idle engine: a plain request, a new schema (compiled on arrival), a cached one.
    if args.quick:
        _report(res, args.json)
        return
    p = prompts[0]
    one = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
    cached = StructuredOutputsParams(json=fresh_schema())
    res["ttft_ms_plain"] = first_token_latency(llm, p, lambda: one, args.trials) * 1e3

    def fresh() -> Any:
        return one.clone(structured_outputs=StructuredOutputsParams(json=fresh_schema()))

    # The first pays a cold compile of the fresh schema's rules; the later ones reuse them (xgrammar's cache).
    new_schema = [first_token_latency(llm, p, fresh, 1) * 1e3 for _ in range(args.trials)]
    res["ttft_ms_new_schema"] = statistics.median(new_schema[1:] or new_schema)
    res["ttft_ms_new_schema_first"] = new_schema[0]
    res["ttft_ms_new_schema_trials"] = [round(v, 2) for v in new_schema]
    res["ttft_ms_cached_schema"] = (
        first_token_latency(llm, p, lambda: one.clone(structured_outputs=cached), args.trials) * 1e3
    )
    _report(res, args.json)


@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    """Environment variables set for the block (the engine reads these knobs at each step)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _pyspy(path: str) -> Iterator[None]:
    """py-spy sampling this process (every thread, idle samples kept) while the block runs."""
    import subprocess

    cmd = ["py-spy", "record", "--pid", str(os.getpid()), "--threads", "--idle", "--rate", "1000", "--nonblocking"]
    proc = subprocess.Popen([*cmd, "--format", "raw", "-o", path, "--duration", "600"])
    time.sleep(1.0)  # attached
    try:
        yield
    finally:
        proc.send_signal(2)  # SIGINT: py-spy writes what it has
        proc.wait(timeout=60)


def _cpu_list(text: str) -> set[int]:
    """A CPU list ("0-3,8") as a set."""
    cpus: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def _report(res: dict[str, Any], path: str | None) -> None:
    for k, v in res.items():
        print(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}")
    if path:
        with open(path, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
