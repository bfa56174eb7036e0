"""The engine on the GPU with decode CUDA graphs (the default) and async scheduling, on tiny random float32
checkpoints (no model file needed): greedy tokens equal HF transformers' by the numerical-comparison policy.
Batches of 20 pad up to the 32-row graph (padded rows: seq_len 0, slot -1), a sliding-window variant has two
KV-cache groups (two slot mappings and block tables in the graph's inputs), and requests of different
lengths leave the batch while others decode (the graph's rows shift)."""

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


def graph_decodes_vs_hf(hf: torch.nn.Module, model_dir: str) -> tuple[Any, list[Any]]:
    """Our engine (decode CUDA graphs) on the checkpoint in `model_dir` against `hf` (on the GPU): 20
    requests of different lengths, padded graph steps and shrinking batches asserted; (runner, verdicts),
    each verdict by the numerical-comparison policy (a failure raises)."""
    rng = random.Random(1)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randrange(3, 40))] for _ in range(20)]
    lengths = [8 + (i * 5) % 25 for i in range(20)]  # requests finish at different steps
    refs = [hf_greedy(hf, p, n) for p, n in zip(prompts, lengths)]
    llm = LLM(model_dir, dtype="float32", skip_tokenizer_init=True, max_model_len=128, kv_cache_memory_bytes=64 << 20)
    runner = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner
    assert runner.cuda_graphs is not None
    replays = []
    real_run = runner.cuda_graphs.run
    runner.cuda_graphs.run = lambda *a, **k: replays.append(len(a[0])) or real_run(*a, **k)  # type: ignore[method-assign]
    sps = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False) for n in lengths]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sps, use_tqdm=False)
    assert replays and max(replays) == 20 and min(replays) < 20  # padded graph steps, shrinking batches
    verdicts = [
        compare_greedy(hf, p, list(o.outputs[0].token_ids), r, torch.float32) for p, o, r in zip(prompts, outs, refs)
    ]
    return runner, verdicts


@pytest.mark.parametrize("variant", ["llama", "qwen2_sliding", "qwen3"])
def test_graph_decodes_match_hf(variant: str, tmp_path) -> None:  # noqa: ANN001
    hf = make_tiny_hf_model(variant, tmp_path).to("cuda")
    runner, _ = graph_decodes_vs_hf(hf, str(tmp_path))
    if "sliding" in variant:
        assert len(runner.kv_cache_config.groups) == 2
