"""Acceptance 2 (CPU): tiny random Llama checkpoints quantized by the reference code in `quant_ref.py`
and saved in each format's layout; the engine's greedy outputs (float32) equal the dequantized float32 HF
model's (activations fake-quantized where the format quantizes them) by the comparison policy, and its
logprobs of the shared tokens agree within 1e-3.

FP8 activations are the exception for logprobs: e4m3 has 3 mantissa bits, so an activation that float32
accumulation-order noise (~1e-7) moves across a rounding boundary changes by one FP8 step (up to 6%), and
a few such flips move a logprob by a few 1e-2. Those cases are held to 0.05; that the engine's FP8 layers
compute exactly the reference's math for the same input is checked layer by layer (1e-5) in
`test_w8a8_ops.py`."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from pagedllm import LLM, SamplingParams, TokensPrompt
from tests.hf_utils import compare_greedy, hf_greedy, hf_logprobs
from tests.model_executor.quantization import quant_ref as qr
from tests.utils_model import VOCAB, make_tiny_hf_model

MAX_TOKENS = 16
LOGPROB_TOL = 1e-3
FP8_ACT_LOGPROB_TOL = 0.05


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(VOCAB) for _ in range(n)] for n in (3, 17, 40, 9)]


def _w8a8_tensors(refs: dict[str, tuple[torch.Tensor, torch.Tensor]], scalar: bool) -> dict[str, torch.Tensor]:
    out = {}
    for name, (q, s) in refs.items():
        out[f"{name}.weight"] = q
        out[f"{name}.weight_scale"] = s.reshape(()) if scalar else s.reshape(-1, 1)
    return out


def _ct_config(kind: str, static: bool) -> dict[str, Any]:
    t = "float" if kind == "fp8" else "int"
    acts = {"num_bits": 8, "type": t, "symmetric": True, "observer": None}
    acts.update({"strategy": "tensor", "dynamic": False} if static else {"strategy": "token", "dynamic": True})
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized" if kind == "fp8" else "int-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": t, "strategy": "channel", "symmetric": True, "dynamic": False},
                "input_activations": acts,
                "output_activations": None,
            }
        },
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
    }


def build_case(case: str, tmp_path: Any, prompts: list[list[int]]) -> tuple[Any, str, dict[str, Any]]:
    """(float32 reference HF model, checkpoint dir, extra LLM kwargs) for one format."""
    base = tmp_path / "base"
    model = make_tiny_hf_model("llama", base, overrides=dict(qr.QUANT_OVERRIDES))
    qdir = str(tmp_path / "quant")
    if case == "fp8-online":
        qr.make_w8a8_reference(model, "fp8", per_channel=True, input_scales=None)
        return model, str(base), {"quantization": "fp8"}
    if case.startswith("int4-"):
        _, fmt, group = case.split("-")
        qr.write_int4_checkpoint(model, qdir, fmt, int(group))
        return model, qdir, {}
    # 8-bit checkpoints: "<fp8|ct>-<fp8|int8>-<dynamic|static>"
    layout, kind, acts = case.split("-")
    static = acts == "static"
    scales = qr.calibrate_input_scales(model, prompts, kind) if static else None
    refs = qr.make_w8a8_reference(model, kind, per_channel=layout == "ct", input_scales=scales)
    tensors = _w8a8_tensors(refs, scalar=layout == "fp8")
    for name, s in (scales or {}).items():
        tensors[f"{name}.input_scale"] = torch.tensor(s) if layout == "fp8" else torch.tensor([s])
    if layout == "fp8":
        qcfg: dict[str, Any] = {"quant_method": "fp8", "activation_scheme": acts}
    else:
        qcfg = _ct_config(kind, static)
    qr.save_checkpoint(model, qdir, tensors, qcfg)
    return model, qdir, {}


CASES = [
    "fp8-online",
    "fp8-fp8-dynamic",
    "fp8-fp8-static",
    "ct-fp8-dynamic",
    "ct-fp8-static",
    "ct-int8-dynamic",
    "ct-int8-static",
    "int4-awq-32",
    "int4-awq-128",
    "int4-gptq-64",
    "int4-gptq-128",
]


@pytest.mark.parametrize("case", CASES)
def test_quantized_checkpoint_matches_dequantized_reference(case: str, prompts: list[list[int]], tmp_path) -> None:  # noqa: ANN001
    torch.set_num_threads(2)
    ref_model, path, kwargs = build_case(case, tmp_path, prompts)
    refs = [hf_greedy(ref_model, p, MAX_TOKENS) for p in prompts]
    llm = LLM(
        path,
        dtype="float32",
        skip_tokenizer_init=True,
        max_model_len=128,
        kv_cache_memory_bytes=8 << 20,
        max_num_batched_tokens=32,  # the 40-token prompt is prefilled in chunks
        **kwargs,
    )
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False, logprobs=0)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    worst = 0.0
    for p, o, r in zip(prompts, outs, refs):
        ours = list(o.outputs[0].token_ids)
        cmp = compare_greedy(ref_model, p, ours, r, torch.float32)
        n = cmp.matched if cmp.diverged_at is None else cmp.diverged_at
        if n == 0:
            continue
        lp = hf_logprobs(ref_model, p + ours[:n])
        for i in range(n):
            ref_lp = float(lp[len(p) - 1 + i, ours[i]])
            got = o.outputs[0].logprobs[i][ours[i]].logprob  # type: ignore[index]
            worst = max(worst, abs(got - ref_lp))
    tol = FP8_ACT_LOGPROB_TOL if case == "fp8-online" or "-fp8-" in case else LOGPROB_TOL
    assert worst < tol, f"{case}: logprob difference {worst:.3g}"


def test_online_fp8_on_a_moe_model(prompts: list[list[int]], tmp_path) -> None:  # noqa: ANN001
    """Online FP8 on a mixture-of-experts model: the attention projections are quantized, the experts and
    the router stay in the model's dtype; greedy as the reference with the same layers fake-quantized."""
    from transformers import MixtralConfig

    cfg = MixtralConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=256,
        tie_word_embeddings=False,
    )  # fmt: skip
    model = make_tiny_hf_model("llama", tmp_path, config=cfg)
    quantized = qr.make_w8a8_reference(model, "fp8", per_channel=True, input_scales=None)
    assert quantized and all(n.split(".")[-1] in ("q_proj", "k_proj", "v_proj", "o_proj") for n in quantized)
    refs = [hf_greedy(model, p, MAX_TOKENS) for p in prompts]
    llm = LLM(str(tmp_path), dtype="float32", skip_tokenizer_init=True, max_model_len=128,
              kv_cache_memory_bytes=8 << 20, quantization="fp8")  # fmt: skip
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    for p, o, r in zip(prompts, outs, refs):
        compare_greedy(model, p, list(o.outputs[0].token_ids), r, torch.float32)
