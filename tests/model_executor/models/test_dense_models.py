"""Issue 18, acceptance 1 (dense architectures): tiny random checkpoints of each added dense architecture
give greedy outputs equal to HF transformers in float32 on the CPU (8 prompts of mixed lengths x 32 tokens
in one batch, once with chunked prefill forced) and prompt logprobs within 1e-4. The prompts run past the
tiny Gemma 3's sliding window (8)."""

from __future__ import annotations

import pytest
import torch

from tests.model_executor.models.hf_check import check_against_hf, mixed_prompts
from tests.model_executor.models.tiny_configs import DENSE_VARIANTS, tiny_config
from tests.utils_model import make_tiny_hf_model

SLOW = {"phi3", "opt_post_ln_proj"}  # CI time: run with `pytest -m slow`


@pytest.mark.parametrize(
    "variant", [pytest.param(v, marks=[pytest.mark.slow] if v in SLOW else []) for v in sorted(DENSE_VARIANTS)]
)
def test_dense_greedy_and_prompt_logprobs_match_hf(variant: str, tmp_path) -> None:  # noqa: ANN001
    torch.set_num_threads(2)
    hf = make_tiny_hf_model(variant, tmp_path, config=tiny_config(DENSE_VARIANTS, variant))
    # Gemma 2 / 3's sliding layers get their own KV-cache group (blocks past the window are dropped).
    check_against_hf(hf, str(tmp_path), mixed_prompts(), expect_sliding_group=variant in ("gemma2", "gemma3"))
