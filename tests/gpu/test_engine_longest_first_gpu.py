"""The decode attention's longest-first launches in the engine (issue 18, W6; `triton_paged_attn.request_order`):
a batch big enough for both of its forms, 64-key tiles at >= SMALL_TILE_WAVES programs per SM and 128-key tiles
above one program per SM, replayed in decode CUDA graphs while it shrinks through both thresholds and below.
Greedy tokens of a tiny random float32 Llama (2 kv heads) equal HF transformers' by the numerical-comparison
policy, for every request."""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from pagedllm import LLM, SamplingParams, TokensPrompt  # noqa: E402
from pagedllm.attention.ops.triton_paged_attn import SMALL_TILE_WAVES  # noqa: E402
from pagedllm.triton_utils import num_sms  # noqa: E402
from tests.hf_utils import compare_greedy, hf_greedy  # noqa: E402
from tests.utils_model import VOCAB, make_tiny_hf_model  # noqa: E402


def test_longest_first_graph_decodes_match_hf(tmp_path) -> None:  # noqa: ANN001
    hf = make_tiny_hf_model("llama", tmp_path).to("cuda")
    kv_heads = hf.config.num_key_value_heads
    n = -(-SMALL_TILE_WAVES * num_sms(torch.device("cuda")) // kv_heads) + 24  # above the 64-key-tile threshold
    rng = random.Random(2)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randrange(3, 40))] for _ in range(n)]
    lengths = [4 + (i * 7) % 29 for i in range(n)]  # the batch shrinks step by step through both thresholds
    llm = LLM(
        str(tmp_path),
        dtype="float32",
        skip_tokenizer_init=True,
        max_model_len=128,
        max_num_seqs=512,
        max_num_batched_tokens=32768,
        kv_cache_memory_bytes=256 << 20,
    )
    runner = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner
    assert runner.cuda_graphs is not None
    replays: list[int] = []
    real_run = runner.cuda_graphs.run
    runner.cuda_graphs.run = lambda *a, **k: replays.append(len(a[0])) or real_run(*a, **k)  # type: ignore[method-assign]
    sps = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, detokenize=False) for m in lengths]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sps, use_tqdm=False)
    assert max(replays) * kv_heads >= SMALL_TILE_WAVES * num_sms(torch.device("cuda"))
    assert min(replays) * kv_heads < num_sms(torch.device("cuda"))
    for p, o, m in zip(prompts, outs, lengths):
        compare_greedy(hf, p, list(o.outputs[0].token_ids), hf_greedy(hf, p, m), torch.float32)
