"""`pagedllm bench serve`: an online load generator for an OpenAI-compatible server (vLLM's
benchmark_serving, reduced): Poisson arrivals at `--request-rate` (or all at once with `inf`), at most
`--max-concurrency` requests in flight, streamed completions; reports request throughput, output tok/s,
TTFT / TPOT / ITL (mean, p50, p90, p99) as a table and optionally as JSON (`--save-result`).

Prompts of the `random` dataset are random token ids sent as `prompt: [ids]`, so the input length is
exact and no tokenizer is needed; `ignore_eos` makes every output exactly `--output-len` tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from typing import Any

from pagedllm import envs
from pagedllm.benchmarks.plot import add_plot_arg, plot_run
from pagedllm.benchmarks.serve_metrics import RequestResult, percentile_metrics, print_table, serve_series, summarize


def add_cli_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="Server URL (without /v1).")
    p.add_argument("--model", default=None, help="Model name to send (default: the server's first model).")
    p.add_argument("--api-key", default=None, help="Bearer token (default: PAGEDLLM_API_KEY / none).")
    p.add_argument(
        "--dataset",
        "--dataset-name",
        dest="dataset",
        default="random",
        choices=["random"],
        help="Prompt source: random token ids.",
    )
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--input-len", "--random-input-len", dest="input_len", type=int, default=128)
    p.add_argument("--output-len", "--random-output-len", dest="output_len", type=int, default=64)
    p.add_argument(
        "--range-ratio",
        "--random-range-ratio",
        dest="range_ratio",
        type=float,
        default=0.0,
        help="Lengths drawn uniformly from [len*(1-r), len*(1+r)].",
    )
    p.add_argument(
        "--vocab-range",
        type=int,
        nargs=2,
        default=[1000, 20000],
        metavar=("LO", "HI"),
        help="Random prompt token ids are drawn from [LO, HI).",
    )
    p.add_argument("--request-rate", type=str, default="inf", help="Requests per second (Poisson), or 'inf'.")
    p.add_argument("--burstiness", type=float, default=1.0, help="Gamma shape of inter-arrival times (1 = Poisson).")
    p.add_argument("--max-concurrency", type=int, default=None, help="Most requests in flight.")
    p.add_argument(
        "--client-processes",
        type=int,
        default=1,
        help="Client processes sharing the requests (every N-th arrival each; --max-concurrency per process): one "
        "Python process parses ~100k streamed chunks/s, below what a multi-GPU server sends.",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Send ignore_eos so every output is exactly its length (vLLM's flag; on by default here, since "
        "random token prompts end early otherwise: --no-ignore-eos to turn it off).",
    )
    p.add_argument(
        "--num-warmups", type=int, default=0, help="Requests sent (and awaited) before the measured run, not counted."
    )
    p.add_argument(
        "--percentiles",
        "--metric-percentiles",
        dest="percentiles",
        default="50,90,99",
        help="Comma-separated percentiles to report.",
    )
    p.add_argument(
        "--percentile-metrics",
        default="ttft,tpot,itl,e2el",
        help="Comma-separated metrics to report percentiles of (ttft, tpot, itl, e2el), as vLLM.",
    )
    p.add_argument(
        "--save-result",
        nargs="?",
        const="",
        default=None,
        metavar="FILE.json",
        help="Write the results as JSON: to FILE.json, or with no value (vLLM's form) to "
        "--result-dir/--result-filename (default: serve-<rate>qps-<timestamp>.json).",
    )
    p.add_argument(
        "--save-detailed",
        action="store_true",
        help="With --save-result: also every request's input and output length, ttft, itl and error (vLLM's flag "
        "and fields) and its send time (sent_at, wall clock: lines up with the engine's PAGEDLLM_STEP_TRACE).",
    )
    p.add_argument("--result-dir", default=".", help="Folder for --save-result without a file name.")
    p.add_argument("--result-filename", default=None, help="File name for --save-result without a file name.")
    p.add_argument("--timeout", type=float, default=6 * 3600, help="Per-request timeout in seconds.")
    add_plot_arg(p)
    return p


def _lengths(mean: int, ratio: float, n: int, rng: random.Random) -> list[int]:
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def make_requests(args: argparse.Namespace) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    ins = _lengths(args.input_len, args.range_ratio, args.num_prompts, rng)
    outs = _lengths(args.output_len, args.range_ratio, args.num_prompts, rng)
    lo, hi = args.vocab_range
    return [([rng.randrange(lo, hi) for _ in range(i)], o) for i, o in zip(ins, outs)]


async def _one(
    session: Any,
    url: str,
    headers: dict[str, str],
    model: str,
    prompt: list[int],
    max_tokens: int,
    timeout: float,
    ignore_eos: bool = True,
) -> RequestResult:
    import aiohttp

    res = RequestResult(prompt_len=len(prompt))
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": ignore_eos,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    res.sent_at = time.time()
    start = res.start = time.perf_counter()
    last = start
    try:
        async with session.post(url, json=body, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return res
            async for raw in resp.content:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = chunk["error"].get("message", "error")
                    return res
                now = time.perf_counter()
                if chunk.get("choices"):
                    if res.ttft == 0.0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
        res.latency = time.perf_counter() - start
        res.ok = True
    except Exception as e:  # network errors are results too
        res.error = f"{type(e).__name__}: {e}"
    return res


def arrival_offsets(args: argparse.Namespace, n: int) -> list[float]:
    """Seconds from the run's start at which each request is sent: all at 0 at rate inf, else Gamma
    inter-arrival times with mean 1/rate (shape 1 = Poisson process)."""
    rate = float("inf") if args.request_rate == "inf" else float(args.request_rate)
    if rate == float("inf"):
        return [0.0] * n
    rng = random.Random(args.seed + 1)
    out, t = [], 0.0
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(args.burstiness, 1.0 / (rate * args.burstiness))
    return out


async def _send_all(
    args: argparse.Namespace,
    model: str | None,
    requests: list[tuple[list[int], int]],
    offsets: list[float],
    warmups: list[tuple[list[int], int]],
    ready: Any = None,
) -> tuple[str, list[RequestResult], float, float]:
    """(model, results, start, end): the warm-ups (not measured), then `requests` sent at `offsets` from the
    start (time.perf_counter: CLOCK_MONOTONIC, the same in every process of the machine). `ready`: a
    barrier the client processes pass together before they start."""
    import aiohttp

    base = args.base_url.rstrip("/")
    key = args.api_key or envs.PAGEDLLM_API_KEY
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as session:
        if model is None:
            async with session.get(f"{base}/v1/models", headers=headers) as r:
                r.raise_for_status()
                model = (await r.json())["data"][0]["id"]
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        url = f"{base}/v1/completions"
        ignore_eos = getattr(args, "ignore_eos", True)

        async def limited(prompt: list[int], out_len: int) -> RequestResult:
            if sem is None:
                return await _one(session, url, headers, model, prompt, out_len, args.timeout, ignore_eos)
            async with sem:
                return await _one(session, url, headers, model, prompt, out_len, args.timeout, ignore_eos)

        if warmups:  # the same kind of request, not measured (vLLM's --num-warmups)
            warm = await asyncio.gather(*(limited(p, o) for p, o in warmups))
            if not any(r.ok for r in warm):
                raise RuntimeError(f"warm-up failed: {warm[0].error}")
        if ready is not None:
            await asyncio.get_running_loop().run_in_executor(None, ready.wait)
        tasks: list[asyncio.Task[RequestResult]] = []
        start = time.perf_counter()
        for (prompt, out_len), at in zip(requests, offsets):
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(limited(prompt, out_len)))
        results = await asyncio.gather(*tasks)
        end = time.perf_counter()
    return model, list(results), start, end


def _client_process(
    args: argparse.Namespace, model: str, requests: list[tuple[list[int], int]], offsets: list[float], ready: Any
) -> tuple[list[RequestResult], float, float]:
    """(A --client-processes worker) its share of the requests."""
    _, results, start, end = asyncio.run(_send_all(args, model, requests, offsets, [], ready))
    return results, start, end


def _run_processes(
    args: argparse.Namespace, requests: list[tuple[list[int], int]], offsets: list[float]
) -> tuple[str, list[RequestResult], float, float]:
    """The requests over --client-processes processes, request i in process i % N at its own offset; the
    results in request order, the run from the first start to the last end."""
    import concurrent.futures as cf
    import multiprocessing as mp

    n = args.client_processes
    warm = requests[: getattr(args, "num_warmups", 0)]
    model, _, _, _ = asyncio.run(_send_all(args, args.model, [], [], warm))  # the model's name; the warm-ups
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager, cf.ProcessPoolExecutor(n, mp_context=ctx) as pool:
        ready = manager.Barrier(n)
        futs = [pool.submit(_client_process, args, model, requests[k::n], offsets[k::n], ready) for k in range(n)]
        parts = [f.result() for f in futs]
    results: list[RequestResult] = [RequestResult()] * len(requests)
    for k, (res, _, _) in enumerate(parts):
        results[k::n] = res
    return model, results, min(p[1] for p in parts), max(p[2] for p in parts)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    requests = make_requests(args)
    offsets = arrival_offsets(args, len(requests))
    if getattr(args, "client_processes", 1) > 1:
        loop = asyncio.get_running_loop()
        model, results, start, end = await loop.run_in_executor(None, _run_processes, args, requests, offsets)
    else:
        warm = requests[: getattr(args, "num_warmups", 0)]
        model, results, start, end = await _send_all(args, args.model, requests, offsets, warm)
    duration = end - start
    summary = summarize(list(results), duration, args)
    summary["model"] = model
    if getattr(args, "plot", None):
        summary["series"] = serve_series(list(results), start)
    if getattr(args, "save_detailed", False):
        summary.update(  # vLLM's per-request fields (`errors` becomes one entry per request), and our sent_at
            input_lens=[r.prompt_len for r in results],
            output_lens=[r.output_tokens for r in results],
            ttfts=[r.ttft for r in results],
            itls=[r.itl for r in results],
            errors=[r.error for r in results],
            sent_at=[r.sent_at for r in results],
        )
    return summary


def main(args: argparse.Namespace) -> int:
    percentile_metrics(args)  # a typo fails before any request is sent
    summary = asyncio.run(run(args))
    print_table(summary, [p.strip() for p in args.percentiles.split(",") if p.strip()])
    if getattr(args, "plot", None):
        plot_run(summary, args.plot, f"bench serve: {summary['model']} ({summary['completed']} requests)")
        print(f"Plot saved to {args.plot}")
    if args.save_result is not None:
        path = args.save_result or os.path.join(
            args.result_dir,
            args.result_filename or f"serve-{args.request_rate}qps-{time.strftime('%Y%m%d-%H%M%S')}.json",
        )
        with open(path, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2)
        print(f"Results saved to {path}")
    if summary["completed"] == 0:
        errors = [e for e in summary.get("errors", []) if e][:10]
        print("error: no request succeeded: " + "; ".join(errors), file=sys.stderr)
        return 1
    return 0


__all__ = ["RequestResult", "add_cli_args", "main", "run", "summarize"]
