"""Acceptance 2: tp=2 through the Ray executor, on a local Ray head started by the test, gives tp=1's outputs."""

from __future__ import annotations

import time
from collections.abc import Iterator

import psutil
import pytest

from tests.executor.parallel_utils import assert_same_outputs, run_engine, tiny_prompts
from tests.utils_model import make_tiny_hf_model

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def ray_head() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


@pytest.mark.slow  # Ray's start and its actors' imports take over a minute on two cores
def test_ray_tp2_matches_tp1(ray_head: None, tmp_path_factory: pytest.TempPathFactory) -> None:
    path = str(tmp_path_factory.mktemp("llama"))
    make_tiny_hf_model("llama", path)
    ref = run_engine(path, tiny_prompts())
    got = run_engine(path, tiny_prompts(), tensor_parallel_size=2, distributed_executor_backend="ray")
    assert_same_outputs(ref, got)
    deadline = time.monotonic() + 10  # the worker actors are killed at shutdown
    while _ray_workers() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _ray_workers()


def _ray_workers() -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["cmdline"]):
        if any("_RayWorker" in part for part in p.info["cmdline"] or []):
            out.append(p)
    return out
