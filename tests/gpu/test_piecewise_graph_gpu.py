"""CUDA graphs for prefill and mixed steps, whole-step (worker/mixed_graph.py, the default) and piecewise
(worker/piecewise_graph.py, PAGEDLLM_MIXED_GRAPHS=piecewise), on tiny random float32 checkpoints: with a
64-token budget every longer prompt is chunked and most steps mix a prefill chunk with decodes, all replayed
through the graphs (padded to 64 tokens and, whole-step, to 64 requests); greedy tokens equal HF transformers' by
the numerical-comparison policy, with one and two KV-cache groups and with Qwen3's q/k norm fused into the RoPE
pass. PAGEDLLM_PIECEWISE_MAX_TOKENS=0 turns both off."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from pagedllm import LLM, SamplingParams, TokensPrompt  # noqa: E402
from tests.hf_utils import compare_greedy, hf_greedy  # noqa: E402
from tests.utils_model import VOCAB, make_tiny_hf_model  # noqa: E402


@pytest.mark.parametrize("mode", ["full", "piecewise"])
@pytest.mark.parametrize("variant", ["llama", "qwen2_sliding", "qwen3"])
def test_piecewise_prefill_matches_hf(variant: str, mode: str, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("PAGEDLLM_MIXED_GRAPHS", mode)
    hf = make_tiny_hf_model(variant, tmp_path).to("cuda")
    rng = random.Random(2)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randrange(5, 90))] for _ in range(12)]
    lengths = [6 + (i * 7) % 20 for i in range(12)]
    refs = [hf_greedy(hf, p, n) for p, n in zip(prompts, lengths)]
    llm = LLM(
        str(tmp_path), dtype="float32", skip_tokenizer_init=True, max_model_len=256,
        kv_cache_memory_bytes=64 << 20, max_num_batched_tokens=64,
    )  # fmt: skip
    runner = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner
    graphs = runner.mixed_graphs if mode == "full" else runner.piecewise
    other = runner.piecewise if mode == "full" else runner.mixed_graphs
    assert graphs is not None and graphs.sizes == [64] and other is None
    sps = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False) for n in lengths]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sps, use_tqdm=False)
    assert graphs.num_runs >= 5  # the chunked prefills went through the graphs
    for p, o, r in zip(prompts, outs, refs):
        compare_greedy(hf, p, list(o.outputs[0].token_ids), r, torch.float32)


def test_piecewise_off(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    make_tiny_hf_model("llama", tmp_path)
    monkeypatch.setenv("PAGEDLLM_PIECEWISE_MAX_TOKENS", "0")
    args: dict[str, Any] = {"dtype": "float32", "skip_tokenizer_init": True, "max_model_len": 128}
    args["kv_cache_memory_bytes"] = 1 << 23
    llm = LLM(str(tmp_path), **args)
    runner = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner
    assert runner.piecewise is None and runner.mixed_graphs is None and runner.cuda_graphs is not None
