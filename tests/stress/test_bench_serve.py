"""`pagedllm bench serve` (vLLM's client options) against the stress suite's server: warm-ups not
counted, exact output lengths with --ignore-eos, only the asked percentile metrics, vLLM's
`--save-result` form writing to --result-dir/--result-filename."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedllm.benchmarks import serve as bench_serve
from tests.entrypoints.openai.test_server import ServerProcess
from tests.stress.conftest import API_KEY


def test_bench_serve_vllm_options(stress_server: ServerProcess, tmp_path: Path) -> None:
    import argparse

    p = bench_serve.add_cli_args(argparse.ArgumentParser())
    args = p.parse_args(
        [
            "--base-url",
            stress_server.url,
            "--api-key",
            API_KEY,
            "--dataset-name",
            "random",
            "--random-input-len",
            "16",
            "--random-output-len",
            "4",
            "--num-prompts",
            "6",
            "--request-rate",
            "50",
            "--seed",
            "3",
            "--ignore-eos",
            "--num-warmups",
            "2",
            "--percentile-metrics",
            "ttft,e2el",
            "--metric-percentiles",
            "50,99",
            "--save-result",
            "--result-dir",
            str(tmp_path),
            "--result-filename",
            "r.json",
            "--save-detailed",
        ]
    )
    assert bench_serve.main(args) == 0
    res = json.loads((tmp_path / "r.json").read_text())
    assert res["completed"] == 6 and res["failed"] == 0  # the warm-ups are not counted
    assert res["total_output_tokens"] == 6 * 4 and res["total_input_tokens"] == 6 * 16
    assert res["p99_ttft_ms"] >= res["p50_ttft_ms"] > 0 and "p99_e2el_ms" in res and "median_ttft_ms" in res
    assert "p99_tpot_ms" not in res and "p50_itl_ms" not in res
    # --save-detailed: per request, its send time (wall clock), TTFT, gaps and length
    assert len(res["sent_at"]) == len(res["ttfts"]) == len(res["itls"]) == 6
    assert res["sent_at"] == sorted(res["sent_at"]) and all(t > 0 for t in res["ttfts"])
    assert res["output_lens"] == [4] * 6 and all(len(g) == 3 for g in res["itls"])
    assert res["input_lens"] == [16] * 6 and res["errors"] == [""] * 6
    bad = p.parse_args(["--percentile-metrics", "ttft,nope"])
    with pytest.raises(ValueError, match="percentile_metrics"):
        bench_serve.main(bad)


def test_bench_serve_client_processes(stress_server: ServerProcess, tmp_path: Path) -> None:
    """--client-processes 2: the requests split over two client processes (every other arrival each), the
    results merged in request order, the run timed from the first start to the last end."""
    import argparse

    p = bench_serve.add_cli_args(argparse.ArgumentParser())
    common = ["--base-url", stress_server.url, "--api-key", API_KEY, "--random-input-len", "8"]
    common += ["--random-output-len", "3", "--num-prompts", "7", "--request-rate", "40", "--seed", "5"]
    out = tmp_path / "two.json"
    args = p.parse_args([*common, "--client-processes", "2", "--save-result", str(out), "--save-detailed"])
    assert bench_serve.main(args) == 0
    res = json.loads(out.read_text())
    assert res["completed"] == 7 and res["failed"] == 0 and res["total_output_tokens"] == 7 * 3
    assert res["output_lens"] == [3] * 7 and res["errors"] == [""] * 7
    # the same Poisson schedule as one process: request i sent about offsets[i] after the start
    offsets = bench_serve.arrival_offsets(args, 7)
    sent = [t - res["sent_at"][0] for t in res["sent_at"]]
    assert all(abs(s - o) < 0.05 for s, o in zip(sent, offsets)), (sent, offsets)
    assert res["duration_s"] >= offsets[-1]
