"""`pagedllm.benchmarks.plot`: the series the benches record for --plot, the figures, `bench compare`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")
from pagedllm.benchmarks.plot import main as compare_main  # noqa: E402
from pagedllm.benchmarks.plot import plot_run, rate_from_token_times, spread_tokens  # noqa: E402
from pagedllm.benchmarks.serve_metrics import RequestResult, serve_series  # noqa: E402


def test_rate_bins_and_spread() -> None:
    assert rate_from_token_times([0.1, 0.5, 1.2, 2.9]) == [[1.0, 2.0], [2.0, 1.0], [3.0, 1.0]]
    assert rate_from_token_times([0.1, 0.3], bin_s=0.5) == [[0.5, 4.0]]
    assert rate_from_token_times([]) == []
    assert spread_tokens([(1.0, 3.0, 3), (0.5, 9.0, 1), (2.0, 2.0, 0)]) == [1.0, 2.0, 3.0, 0.5]


def test_serve_series_token_times() -> None:
    a = RequestResult(ok=True, output_tokens=3, ttft=0.5, latency=1.0, itl=[0.25, 0.25], start=10.0)
    b = RequestResult(ok=True, output_tokens=2, ttft=1.0, latency=1.6, itl=[0.6], start=11.0)
    failed = RequestResult(ok=False, ttft=0.1, start=10.0)
    s = serve_series([a, b, failed], run_start=10.0)
    # token times: a at 0.5, 0.75, 1.0; b at 2.0, 2.6 -> bins [0,1): 2, [1,2): 1, [2,3): 2
    assert s["rate"] == [[1.0, 2.0], [2.0, 1.0], [3.0, 2.0]]
    assert s["latency"] == {"TTFT": [0.5, 1.0], "ITL": [0.25, 0.25, 0.6], "E2E": [1.0, 1.6]}


def _run(seed: int) -> dict:
    import random

    rng = random.Random(seed)
    times = sorted(rng.uniform(0, 20) for _ in range(500))
    return {
        "output_throughput": 25.0 + seed,
        "model": "m",
        "series": {
            "rate": rate_from_token_times(times),
            "latency": {
                "TTFT": [rng.uniform(0.05, 2) for _ in range(50)],
                "ITL": [rng.uniform(0.01, 0.2) for _ in range(400)],
            },
        },
    }


def test_plot_run_and_compare(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import matplotlib.image

    out = tmp_path / "run.png"
    plot_run(_run(0), str(out), "a run")
    img = matplotlib.image.imread(str(out))
    assert img.shape[0] > 200 and img.shape[1] > 600 and out.stat().st_size < 300_000
    assert img[..., :3].std() > 0.05  # something was drawn, not a blank canvas

    paths = []
    for i, run in enumerate((_run(1), {**_run(2), "series": {}})):
        p = tmp_path / f"r{i}.json"
        p.write_text(json.dumps(run))
        paths.append(str(p))
    cmp = tmp_path / "cmp.png"
    assert compare_main(argparse.Namespace(results=paths, plot=str(cmp))) == 0
    text = capsys.readouterr().out
    assert "output_throughput" in text and "26" in text and "27" in text
    assert "no 'series' in" in text  # the run without series is named, the other still drawn
    assert matplotlib.image.imread(str(cmp)).shape[0] > img.shape[0]  # a rate row and a CDF row per run
