"""The quantization registry's start-up errors: an unknown method, a method that contradicts the
checkpoint, unsupported bit widths / group sizes / schemes, each a ValueError naming the field."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from pagedllm.model_executor.layers.quantization.base import get_quantization_config

AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
CT_FP8 = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
        }
    },
    "ignore": ["lm_head"],
}


def _cfg(qc: dict[str, Any] | None) -> Any:
    return SimpleNamespace(quantization_config=qc) if qc is not None else SimpleNamespace()


def test_methods_resolve() -> None:
    assert get_quantization_config(None, _cfg(None)) is None
    assert get_quantization_config("fp8", _cfg(None)).describe().startswith("fp8 (online")  # type: ignore[union-attr]
    assert get_quantization_config(None, _cfg(AWQ)).name == "awq"  # type: ignore[union-attr]
    assert get_quantization_config("awq_marlin", _cfg(AWQ)).name == "awq"  # type: ignore[union-attr]
    assert get_quantization_config(None, _cfg(GPTQ)).name == "gptq"  # type: ignore[union-attr]
    assert get_quantization_config(None, _cfg(CT_FP8)).name == "compressed-tensors"  # type: ignore[union-attr]
    fp8 = get_quantization_config(None, _cfg({"quant_method": "fp8", "activation_scheme": "static"}))
    assert fp8 is not None and "static" in fp8.describe()


@pytest.mark.parametrize(
    ("quantization", "qc", "match"),
    [
        ("int3", None, r"quantization: unsupported method 'int3'"),
        ("awq", None, r"quantization: 'awq' needs a pre-quantized checkpoint"),
        ("awq", GPTQ, r"quantization: 'awq' does not match the checkpoint.*quant_method='gptq'"),
        ("fp8", AWQ, r"does not match the checkpoint"),
        (None, {**GPTQ, "bits": 8}, r"quantization_config.bits: gptq with 8 bits"),
        (None, {**AWQ, "group_size": 256}, r"quantization_config.group_size: 256"),
        (None, {**GPTQ, "group_size": -1}, r"quantization_config.group_size: -1"),
        (None, {**GPTQ, "desc_act": True}, r"quantization_config.desc_act"),
        (None, {**AWQ, "version": "gemv"}, r"quantization_config.version"),
        (
            None,
            {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
            r"weight_block_size",
        ),
        (None, {"quant_method": "fp8", "activation_scheme": "per-group"}, r"activation_scheme"),
        (None, {"quant_method": "bitsandbytes"}, r"unsupported method 'bitsandbytes'"),
    ],
)
def test_bad_configs_name_the_field(quantization: str | None, qc: dict[str, Any] | None, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        get_quantization_config(quantization, _cfg(qc))


def _ct(**changes: Any) -> dict[str, Any]:
    group = {k: dict(v) if isinstance(v, dict) else v for k, v in CT_FP8["config_groups"]["group_0"].items()}  # type: ignore[index]
    for path, value in changes.items():
        section, key = path.split("__")
        if key == "":
            group[section] = value
        else:
            group[section][key] = value
    return {**CT_FP8, "config_groups": {"group_0": group}}


@pytest.mark.parametrize(
    ("qc", "match"),
    [
        (_ct(weights__num_bits=4), r"config_groups.group_0.weights.num_bits: 4 bits"),
        (_ct(weights__strategy="group"), r"weights.strategy: 'group'"),
        (_ct(weights__symmetric=False), r"weights.symmetric"),
        (_ct(input_activations__=None), r"input_activations: weight-only"),
        (_ct(input_activations__strategy="channel", input_activations__dynamic=False), r"input_activations.strategy"),
        ({**CT_FP8, "format": "pack-quantized"}, r"format: 'pack-quantized'"),
    ],
)
def test_bad_compressed_tensors_schemes(qc: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        get_quantization_config(None, _cfg(qc))


def test_engine_start_up_errors(tmp_path) -> None:  # noqa: ANN001
    """Through `LLM`: the error reaches the user at start-up, naming the field."""
    from pagedllm import LLM
    from tests.model_executor.quantization import quant_ref as qr
    from tests.utils_model import make_tiny_hf_model

    make_tiny_hf_model("llama", tmp_path / "plain")
    with pytest.raises(ValueError, match="quantization: unsupported method 'nf4'"):
        LLM(str(tmp_path / "plain"), quantization="nf4", skip_tokenizer_init=True, dtype="float32")
    with pytest.raises(ValueError, match="'gptq' needs a pre-quantized checkpoint"):
        LLM(str(tmp_path / "plain"), quantization="gptq", skip_tokenizer_init=True, dtype="float32")
    # group 128 does not divide the tiny model's hidden size (64)
    model = make_tiny_hf_model("llama", tmp_path / "base")
    qr.write_int4_checkpoint(model, str(tmp_path / "awq"), "awq", 32)
    import json

    cfg_path = tmp_path / "awq" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["quantization_config"]["group_size"] = 128
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="quantization_config.group_size: 128 does not divide the input size 64"):
        LLM(str(tmp_path / "awq"), skip_tokenizer_init=True, dtype="float32", kv_cache_memory_bytes=8 << 20)


def test_prequantized_moe_refused(tmp_path) -> None:  # noqa: ANN001
    """A pre-quantized mixture-of-experts checkpoint fails at start-up naming `quantization` (the experts
    have no quantized kernels), instead of a missing-weights error."""
    import json

    from transformers import MixtralConfig

    from pagedllm import LLM
    from tests.utils_model import make_tiny_hf_model

    cfg = MixtralConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=256, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=128,
    )  # fmt: skip
    make_tiny_hf_model("llama", tmp_path, config=cfg)
    path = tmp_path / "config.json"
    data = json.loads(path.read_text())
    data["quantization_config"] = {**GPTQ, "group_size": 32}
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="quantization: 'gptq' checkpoints of mixture-of-experts models"):
        LLM(str(tmp_path), skip_tokenizer_init=True, dtype="float32", kv_cache_memory_bytes=8 << 20)
