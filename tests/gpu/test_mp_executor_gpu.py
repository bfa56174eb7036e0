"""The multi-process executor at tp=1 on one GPU (issue 24): the worker in its own process, with decode CUDA
graphs and async scheduling (the defaults), gives the in-process executor's greedy tokens, and the engine
really launches steps ahead. Tiny random float32 checkpoints (no model file needed)."""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from pagedllm import LLM, SamplingParams, TokensPrompt  # noqa: E402
from tests.utils_model import VOCAB, make_tiny_hf_model  # noqa: E402


def _run(model_dir: str, backend: str) -> tuple[list[list[int]], int, list[bool]]:
    rng = random.Random(1)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randrange(3, 40))] for _ in range(20)]
    lengths = [8 + (i * 5) % 25 for i in range(20)]
    llm = LLM(
        model_dir,
        dtype="float32",
        skip_tokenizer_init=True,
        max_model_len=128,
        kv_cache_memory_bytes=64 << 20,
        distributed_executor_backend=backend,
    )
    try:
        graphs = llm.collective_rpc(lambda worker: worker.model_runner.cuda_graphs is not None)
        sps = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False) for n in lengths]
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sps, use_tqdm=False)
        ahead = llm.llm_engine.engine_core.engine_core.num_steps_ahead
        return [list(o.outputs[0].token_ids) for o in outs], ahead, graphs
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_mp_tp1_matches_in_process(tmp_path) -> None:  # noqa: ANN001
    make_tiny_hf_model("llama", tmp_path)
    ref, _, _ = _run(str(tmp_path), "uni")
    got, ahead, graphs = _run(str(tmp_path), "mp")
    assert graphs == [True]  # decode CUDA graphs captured in the worker process
    assert ahead > 0  # async scheduling launched steps ahead through the worker loop
    assert got == ref
