"""Access to the benchmark workloads (W1..W4) kept in the repo under benchmarks/workloads/ (a copy of
the shared definitions, so it travels to the GPU machine)."""

from __future__ import annotations

import importlib.util
import os
from types import ModuleType

from pagedllm import envs

TINY_OVERRIDES = {
    "num_hidden_layers": 1,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
}
"""`hf_overrides` for one narrow layer (the vocabulary kept): a step is then mostly the engine's host work."""


def workloads_dir() -> str:
    env = envs.PAGEDLLM_WORKLOADS_DIR
    if env:
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.normpath(os.path.join(here, "..", "..", "benchmarks", "workloads"))


def load_workloads_module() -> ModuleType:
    path = os.path.join(workloads_dir(), "workloads.py")
    if not os.path.isfile(path):
        raise ValueError(f"workload: definitions not found at {path} (set PAGEDLLM_WORKLOADS_DIR)")
    spec = importlib.util.spec_from_file_location("pagedllm_bench_workloads", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def get_workload(name: str) -> tuple[list[tuple[list[int], int]], str, float]:
    """(requests as (prompt ids, output len), model config dir, temperature)."""
    mod = load_workloads_module()
    if name not in mod.WORKLOADS:
        raise ValueError(f"workload: unknown {name!r}; expected one of {', '.join(mod.WORKLOADS)}")
    w = mod.WORKLOADS[name]
    return w["make"](), mod.MODELS[w["model"]], float(w["temperature"])
