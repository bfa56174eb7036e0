"""Fixtures for the engine-control tests: two tiny random Llama checkpoints (A and B, same shapes,
different weights) and prompts, made once per session."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from tests.utils_model import VOCAB, make_tiny_hf_model

ENGINE_KW: dict[str, Any] = dict(
    dtype="float32",
    skip_tokenizer_init=True,
    max_model_len=128,
    kv_cache_memory_bytes=8 << 20,
    max_num_batched_tokens=64,
    enable_sleep_mode=True,
)


@pytest.fixture(scope="session")
def tiny_ckpts(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """(A, B): tiny random Llama safetensors checkpoints of the same shape (fused qkv / gate_up parameters
    exercised through the checkpoint names). The bias variant is not used: its greedy outputs are constant."""
    torch.set_num_threads(2)
    root = tmp_path_factory.mktemp("rl_ckpts")
    a, b = root / "A", root / "B"
    make_tiny_hf_model("llama", a, seed=0)
    make_tiny_hf_model("llama", b, seed=1)
    return str(a), str(b)


@pytest.fixture(scope="session")
def rl_prompts() -> list[list[int]]:
    rng = random.Random(26)
    return [[rng.randrange(VOCAB) for _ in range(n)] for n in (5, 19, 33, 8, 40, 12)]
