"""Pipeline parallelism with two batches in flight on two GPUs (NCCL between the stages): greedy tokens
equal the one-GPU in-process engine's, and the batch queue held two launched batches at once. Tiny random
float32 Llama (no model file needed). Needs two GPUs (skipped otherwise)."""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA GPUs", allow_module_level=True)

from pagedllm import LLM, SamplingParams, TokensPrompt  # noqa: E402
from tests.executor.parallel_utils import assert_same_outputs  # noqa: E402
from tests.utils_model import VOCAB, make_tiny_hf_model  # noqa: E402


def _run(model_dir: str, pp: int) -> tuple[list, int]:
    rng = random.Random(3)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randrange(3, 60))] for _ in range(48)]
    llm = LLM(
        model_dir,
        dtype="float32",
        skip_tokenizer_init=True,
        max_model_len=128,
        kv_cache_memory_bytes=64 << 20,
        max_num_seqs=16,
        max_num_batched_tokens=128,
        pipeline_parallel_size=pp,
    )
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, detokenize=False, logprobs=2)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
        bq = llm.llm_engine.engine_core.engine_core.batch_queue
        return [o.outputs[0] for o in outs], (bq.max_in_flight if bq is not None else 1)
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_pp2_batch_queue_matches_one_gpu(tmp_path) -> None:  # noqa: ANN001
    make_tiny_hf_model("llama", tmp_path)
    ref, _ = _run(str(tmp_path), 1)
    got, in_flight = _run(str(tmp_path), 2)
    assert in_flight == 2
    assert_same_outputs(ref, got)  # greedy up to a near tie, logprobs within 1e-4
