"""`pagedllm serve` on the GPU machine, end to end (the AsyncLLM engine-core process on the GPU path): starts
the server on a model, then checks over HTTP (urllib, no client package needed) a chat completion, a
streamed completion, an OpenAI-style 400 for a bad field (and that the server still answers), /metrics,
and 128 concurrent completions (ignore_eos, 128 tokens each: total output tok/s). Prints a table last and
writes JSON to --out.

    python benchmarks/gpu_serve_check.py MODEL [--out FILE.json] [--port 8011]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any


def _post(url: str, body: dict[str, Any], timeout: float = 120) -> tuple[int, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read().decode()
            return r.status, (raw if body.get("stream") else json.loads(raw))
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode())


def _get(url: str, timeout: float = 10) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except (urllib.error.URLError, ConnectionError):
        return 0, ""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--port", type=int, default=8011)
    ap.add_argument("--out", default=None)
    ap.add_argument("--concurrency", type=int, default=128)
    args = ap.parse_args()
    base = f"http://127.0.0.1:{args.port}"
    t0 = time.perf_counter()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pagedllm",
            "serve",
            args.model,
            "--port",
            str(args.port),
            "--max-model-len",
            "2048",
            "--disable-log-requests",
        ],
        env=os.environ.copy(),
    )
    res: dict[str, Any] = {}
    try:
        while _get(base + "/health")[0] != 200:
            if server.poll() is not None or time.perf_counter() - t0 > 240:
                raise SystemExit(f"server did not come up (exit {server.poll()})")
            time.sleep(0.5)
        res["startup_s"] = round(time.perf_counter() - t0, 1)
        model = json.loads(_get(base + "/v1/models")[1])["data"][0]["id"]
        code, chat = _post(
            base + "/v1/chat/completions",
            {
                "model": model,
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 32,
                "temperature": 0,
            },
        )
        res["chat"] = [code, chat["choices"][0]["message"]["content"] if code == 200 else chat]
        code, stream = _post(
            base + "/v1/completions",
            {"model": model, "prompt": "The capital of France is", "max_tokens": 16, "temperature": 0, "stream": True},
        )
        chunks = [ln for ln in stream.splitlines() if ln.startswith("data: ")]
        res["stream"] = [code, len(chunks), chunks[-1] if chunks else None]
        code, bad = _post(base + "/v1/completions", {"model": model, "prompt": "x", "max_tokens": -3})
        res["bad_request"] = [code, bad.get("error", {}).get("type") if isinstance(bad, dict) else bad]
        res["after_bad_health"] = _get(base + "/health")[0]
        metrics = _get(base + "/metrics")[1]
        res["metrics_lines"] = sum(1 for ln in metrics.splitlines() if ln.startswith("pagedllm:"))

        body = {"model": model, "max_tokens": 128, "temperature": 0.8, "ignore_eos": True}
        prompts = [f"Request {i}: write a long story about a robot number {i}." for i in range(args.concurrency)]
        t = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            outs = list(pool.map(lambda p: _post(base + "/v1/completions", {**body, "prompt": p}), prompts))
        dt = time.perf_counter() - t
        ok = [o for c, o in outs if c == 200]
        toks = sum(o["usage"]["completion_tokens"] for o in ok)
        res["concurrent"] = {
            "requests": len(outs),
            "ok": len(ok),
            "output_tokens": toks,
            "seconds": round(dt, 2),
            "output_tok_s": round(toks / dt),
        }
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    print("==== pagedllm serve on the GPU ====")
    for k, v in res.items():
        print(f"{k:18s} {v}")
    good = (
        res["chat"][0] == 200
        and res["stream"][0] == 200
        and res["bad_request"][0] == 400
        and res["after_bad_health"] == 200
        and res["concurrent"]["ok"] == args.concurrency
    )
    print("serve check:", "PASS" if good else "FAIL")
    sys.exit(0 if good else 1)


if __name__ == "__main__":
    main()
