"""Issue 18, acceptance 2: the engine on the GPU with decode CUDA graphs (the default) on a tiny random
float32 Qwen3-MoE checkpoint (and Qwen2-MoE with its shared expert): greedy tokens equal HF transformers'
by the numerical-comparison policy, with batches padded up to a graph size and shrinking as requests end."""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from pagedllm import LLM, SamplingParams, TokensPrompt  # noqa: E402
from tests.hf_utils import compare_greedy, hf_greedy  # noqa: E402
from tests.model_executor.models.tiny_configs import MOE_VARIANTS, tiny_config  # noqa: E402
from tests.utils_model import VOCAB, make_tiny_hf_model  # noqa: E402


@pytest.mark.parametrize("variant", ["qwen3_moe", "qwen2_moe"])
def test_moe_graph_decodes_match_hf(variant: str, tmp_path) -> None:  # noqa: ANN001
    hf = make_tiny_hf_model(variant, tmp_path, config=tiny_config(MOE_VARIANTS, variant)).to("cuda")
    rng = random.Random(1)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randrange(3, 40))] for _ in range(20)]
    lengths = [8 + (i * 5) % 25 for i in range(20)]
    refs = [hf_greedy(hf, p, n) for p, n in zip(prompts, lengths)]
    llm = LLM(
        str(tmp_path), dtype="float32", skip_tokenizer_init=True, max_model_len=128, kv_cache_memory_bytes=64 << 20
    )
    runner = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner
    assert runner.cuda_graphs is not None
    replays = []
    real_run = runner.cuda_graphs.run
    runner.cuda_graphs.run = lambda *a, **k: replays.append(len(a[0])) or real_run(*a, **k)  # type: ignore[method-assign]
    sps = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False) for n in lengths]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sps, use_tqdm=False)
    assert replays and max(replays) == 20 and min(replays) < 20
    verdicts = [
        compare_greedy(hf, p, list(o.outputs[0].token_ids), r, torch.float32) for p, o, r in zip(prompts, outs, refs)
    ]
    print(variant, sum(v.diverged_at is None for v in verdicts), "of", len(verdicts), "identical")
