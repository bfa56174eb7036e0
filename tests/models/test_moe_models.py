"""Issue 18, acceptance 1 (MoE): tiny random Qwen3-MoE, Qwen2-MoE (shared expert + gate) and Mixtral
checkpoints, saved per expert as HF does, give greedy outputs equal to HF transformers in float32 on the
CPU (8 prompts of mixed lengths x 32 tokens in one batch, once with chunked prefill forced) and prompt
logprobs within 1e-4. Two experts of layer 0 get identical router rows, so every token's routing ties
between them, and one prompt repeats a single token (tokens of a batch routed identically)."""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm import LLM, SamplingParams, TokensPrompt
from tests.hf_utils import compare_greedy, hf_greedy, hf_logprobs
from tests.models.tiny_configs import MOE_VARIANTS, tiny_config
from tests.utils_model import VOCAB, make_tiny_hf_model

MAX_TOKENS = 32
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(18)
    out = [[rng.randrange(VOCAB) for _ in range(n)] for n in (3, 9, 17, 30, 41, 12, 25)]
    return out + [[7] * 20]


def _tie_router_rows(hf) -> None:  # noqa: ANN001
    """Experts 1 and 2 of layer 0 get the same router row: equal logits for every token."""
    with torch.no_grad():
        gate = hf.model.layers[0].mlp.gate
        gate.weight[2].copy_(gate.weight[1])


def _llm(path: str, chunk: int) -> LLM:
    return LLM(
        path,
        dtype="float32",
        skip_tokenizer_init=True,
        max_model_len=128,
        kv_cache_memory_bytes=8 << 20,
        max_num_batched_tokens=chunk,
        enable_prefix_caching=False,
    )


@pytest.mark.parametrize("variant", sorted(MOE_VARIANTS))
def test_moe_greedy_and_prompt_logprobs_match_hf(variant: str, prompts: list[list[int]], tmp_path) -> None:  # noqa: ANN001
    torch.set_num_threads(2)
    config = tiny_config(MOE_VARIANTS, variant)
    hf = make_tiny_hf_model(variant, tmp_path, config=config)
    _tie_router_rows(hf)
    hf.save_pretrained(str(tmp_path), safe_serialization=True)
    refs = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False, prompt_logprobs=0)
    reqs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    for chunk in (256, 16):  # 16: every prompt above 16 tokens is prefilled in chunks
        llm = _llm(str(tmp_path), chunk)
        outs = llm.generate(reqs, sp, use_tqdm=False)
        for p, o, r in zip(prompts, outs, refs):
            compare_greedy(hf, p, list(o.outputs[0].token_ids), r, torch.float32)
            ref_lp = hf_logprobs(hf, p)
            plp = o.prompt_logprobs
            assert plp is not None and plp[0] is None and len(plp) == len(p)
            for i in range(1, len(p)):
                got = plp[i][p[i]].logprob
                want = float(ref_lp[i - 1, p[i]])
                assert abs(got - want) < LOGPROB_TOL, (variant, chunk, i, got, want)
        del llm


def test_expert_weights_are_stacked_from_per_expert_tensors(tmp_path) -> None:  # noqa: ANN001
    """The loader fills w13 [E, 2I, H] / w2 [E, H, I] from experts.{e}.{gate,up,down}_proj (and Mixtral's
    block_sparse_moe.experts.{e}.w1/w3/w2) in expert order; a missing expert fails loading by name."""
    from pagedllm.model_executor.model_loader.loader import build_model
    from pagedllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

    config = tiny_config(MOE_VARIANTS, "mixtral")
    hf = make_tiny_hf_model("mixtral", tmp_path, config=config)
    model = build_model(config, torch.float32, "cpu")
    files = [str(p) for p in tmp_path.glob("*.safetensors")]
    loaded = model.load_weights(safetensors_weights_iterator(files))
    assert {n for n, _ in model.named_parameters()} <= loaded
    ours = model.model.layers[1].mlp.experts
    theirs = hf.model.layers[1].mlp.experts  # transformers v5 stacks them the same way
    torch.testing.assert_close(ours.w13_weight, theirs.gate_up_proj, rtol=0, atol=0)
    torch.testing.assert_close(ours.w2_weight, theirs.down_proj, rtol=0, atol=0)
    partial = [(n, t) for n, t in safetensors_weights_iterator(files) if "experts.3.w2" not in n]
    model2 = build_model(config, torch.float32, "cpu")
    loaded2 = model2.load_weights(partial)
    assert "model.layers.0.mlp.experts.w2_weight" not in loaded2
