"""Issue 18, acceptance 1 (MoE): tiny random Qwen3-MoE, Qwen2-MoE (shared expert + gate), Mixtral and OLMoE
checkpoints, saved per expert as HF does, give greedy outputs equal to HF transformers in float32 on the
CPU (8 prompts of mixed lengths x 32 tokens in one batch, once with chunked prefill forced) and prompt
logprobs within 1e-4. Two experts of layer 0 get identical router rows, so every token's routing ties
between them, and one prompt repeats a single token (tokens of a batch routed identically)."""

from __future__ import annotations

import pytest
import torch

from tests.model_executor.models.hf_check import check_against_hf, mixed_prompts
from tests.model_executor.models.tiny_configs import MOE_VARIANTS, tiny_config
from tests.utils_model import make_tiny_hf_model


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return mixed_prompts() + [[7] * 20]  # one prompt of a single repeated token


def _tie_router_rows(hf) -> None:  # noqa: ANN001
    """Experts 1 and 2 of layer 0 get the same router row: equal logits for every token."""
    with torch.no_grad():
        gate = hf.model.layers[0].mlp.gate
        gate.weight[2].copy_(gate.weight[1])


SLOW = {"qwen3_moe_dense_layer", "olmoe"}  # CI time: run with `pytest -m slow`


@pytest.mark.parametrize(
    "variant", [pytest.param(v, marks=[pytest.mark.slow] if v in SLOW else []) for v in sorted(MOE_VARIANTS)]
)
def test_moe_greedy_and_prompt_logprobs_match_hf(variant: str, prompts: list[list[int]], tmp_path) -> None:  # noqa: ANN001
    torch.set_num_threads(2)
    hf = make_tiny_hf_model(variant, tmp_path, config=tiny_config(MOE_VARIANTS, variant))
    _tie_router_rows(hf)
    hf.save_pretrained(str(tmp_path), safe_serialization=True)
    check_against_hf(hf, str(tmp_path), prompts)


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
