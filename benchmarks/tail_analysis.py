"""Where a served request's first-token time goes, from a `pagedllm bench serve --save-result F --save-detailed`
file and the engine's `PAGEDLLM_STEP_TRACE` (same machine, same wall clock; issue 17's latency tails).

    python3 benchmarks/tail_analysis.py --bench S1_rate_16.json --trace trace_S1.jsonl [--top 8]

Client requests and engine `add` events are matched in send order (each request to the first unmatched add at
or after its send time). Per request the TTFT splits into: send -> the core has it (API server, ZMQ, and the
wait for the core's loop, which reads its inputs between steps), -> first
scheduled (queueing behind steps already scheduled), -> the step with its first token read, -> the client has
the token (output path). Printed: the split's median and p99 over all requests, the slowest requests with the
steps they waited behind, and the step durations by kind (decode only / with prefill tokens).
"""

from __future__ import annotations

import argparse
import bisect
import json
import statistics
from typing import Any


def _pct(v: list[float], p: float) -> float:
    s = sorted(v)
    return s[min(len(s) - 1, round((len(s) - 1) * p / 100))] if s else float("nan")


def load_trace(path: str) -> tuple[list[dict[str, Any]], dict[int, dict[str, Any]], dict[int, dict[str, Any]]]:
    adds, sched, done = [], {}, {}
    gcs: list[dict[str, Any]] = []
    with open(path) as f:
        for line in f:
            ev = json.loads(line)
            if ev["ev"] == "add":
                adds.append(ev)
            elif ev["ev"] == "sched":
                sched[ev["step"]] = ev
            elif ev["ev"] == "done":
                done[ev["step"]] = ev
            elif ev["ev"] == "gc":
                gcs.append(ev)
    for d in done.values():  # GC pauses between a step's scheduling and its results (gen 2 counted apart)
        s = sched.get(d["step"])
        inside = [g for g in gcs if s is not None and s["t"] <= g["t"] <= d["t"]]
        d["gc_ms"] = sum(g["ms"] for g in inside)
        d["gc2"] = sum(1 for g in inside if g["gen"] == 2)
    return adds, sched, done


def _alloc_calls(done: dict[int, dict[str, Any]], k: int) -> float:
    """cudaMalloc + cudaFree calls and retries of the caching allocator since the previous step's results."""
    now, before = done[k].get("alloc"), done.get(k - 1, {}).get("alloc")
    return float(sum(now) - sum(before)) if now and before else 0.0


def slow_steps(sched: dict[int, dict[str, Any]], done: dict[int, dict[str, Any]]) -> None:
    """Steps of one kind (decode only / with prefill) split at their median + 5 ms: how the slow ones differ
    (CPU seconds of the core process, host launch time, device span, GC pauses, batch)."""
    for kind in ("decode only", "with prefill"):
        rows = []
        for k, d in done.items():
            s = sched.get(k)
            if s is not None and bool(s["prefill_tokens"]) == (kind == "with prefill"):
                rows.append(
                    (
                        (d["t"] - s["t"]) * 1e3, d.get("cpu", 0.0) * 1e3, d["gc_ms"], d["gc2"], s["decodes"],
                        d.get("launch_ms", 0.0), d.get("gpu_ms", 0.0), d.get("launch_cpu_ms", 0.0),
                        _alloc_calls(done, k),
                    )
                )  # fmt: skip
        if not rows:
            continue
        cut = statistics.median(r[0] for r in rows) + 5
        for name, part in (("fast", [r for r in rows if r[0] < cut]), ("slow", [r for r in rows if r[0] >= cut])):
            if part:
                m = [statistics.fmean(r[i] for r in part) for i in range(9)]
                print(
                    f"  {kind:12s} {name}: n {len(part):5d}  wall {m[0]:6.2f} ms  cpu {m[1]:6.2f}  launch {m[5]:6.2f} "
                    f"(its cpu {m[7]:6.2f})  gpu {m[6]:6.2f}  gc {m[2]:5.2f} ms ({m[3]:.2f} gen-2)  "
                    f"allocator calls {m[8]:.2f}  decodes {m[4]:5.1f}"
                )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bench", required=True)
    ap.add_argument("--trace", required=True)
    ap.add_argument("--top", type=int, default=8)
    args = ap.parse_args()
    bench = json.load(open(args.bench))
    adds, sched, done = load_trace(args.trace)
    first_sched = {rid: s["step"] for s in sorted(sched.values(), key=lambda s: s["step"]) for rid in s["new"]}
    first_done = {rid: d for d in done.values() for rid in d["first"]}
    add_t = [a["t"] for a in adds]
    taken: set[int] = set()
    rows = []
    for sent, ttft in sorted(zip(bench["sent_at"], bench["ttfts"])):
        if not ttft:
            continue
        i = bisect.bisect_left(add_t, sent - 0.05)
        while i < len(adds) and i in taken:
            i += 1
        if i >= len(adds):
            break
        taken.add(i)
        rid = adds[i]["id"]
        st = first_sched.get(rid)
        d = first_done.get(rid)
        if st is None or d is None:
            continue
        s = sched[st]
        rows.append(
            dict(
                id=rid, sent=sent, ttft=ttft * 1e3, to_core=(adds[i]["t"] - sent) * 1e3,
                queued=(s["t"] - adds[i]["t"]) * 1e3, step=(d["t"] - s["t"]) * 1e3,
                out=(sent + ttft - d["t"]) * 1e3, sched_step=st, done_step=d["step"],
            )
        )  # fmt: skip
    print(f"{len(rows)} requests matched of {len(bench['ttfts'])}")
    for k in ("ttft", "to_core", "queued", "step", "out"):
        v = [r[k] for r in rows]
        p50, p90, p99 = (_pct(v, p) for p in (50, 90, 99))
        print(f"  {k:8s} p50 {p50:7.2f} ms   p90 {p90:7.2f}   p99 {p99:7.2f}   mean {statistics.fmean(v):7.2f}")
    steps = sorted(done)
    dur: dict[str, list[float]] = {"decode only": [], "with prefill": []}
    for a, b in zip(steps, steps[1:]):
        if b == a + 1 and b in sched:
            kind = "with prefill" if sched[b]["prefill_tokens"] else "decode only"
            dur[kind].append((done[b]["t"] - done[a]["t"]) * 1e3)
    for kind, v in dur.items():
        if v:
            print(f"  step interval, {kind}: n {len(v)}  p50 {_pct(v, 50):.2f} ms  p99 {_pct(v, 99):.2f}")
    slow_steps(sched, done)
    print(f"slowest {args.top} by TTFT (steps from the one in flight at arrival to the request's first):")
    for r in sorted(rows, key=lambda r: -r["ttft"])[: args.top]:
        print(
            f"  ttft {r['ttft']:6.1f} = core {r['to_core']:5.1f} + queued {r['queued']:5.1f} + step {r['step']:5.1f} "
            f"+ out {r['out']:5.1f}  (scheduled in step {r['sched_step']}, first token read after {r['done_step']})"
        )
        t0 = r["sent"]
        for k in range(r["sched_step"] - 3, r["done_step"] + 1):
            if k in sched:
                s, d = sched[k], done.get(k)
                end = f"{(d['t'] - t0) * 1e3:7.1f}" if d else "      ?"
                print(
                    f"      step {k}: scheduled {(s['t'] - t0) * 1e3:7.1f} ms, read {end} ms; {s['tokens']} tokens "
                    f"({s['prefill_tokens']} prefill, {s['decodes']} decodes, {len(s['new'])} new), "
                    f"waiting {s['waiting']} running {s['running']}"
                )


if __name__ == "__main__":
    main()
