"""float32 encoders with bf16 GEMMs on the CPU (`pooling/cpu_mixed.py`): the real all-MiniLM-L6-v2 keeps
acceptance 1's bar (cosine >= 0.9999 to sentence-transformers' own float32 output), and the mode is chosen
as documented (dtype="auto" on CPUs with native bf16; dtype="float32" stays float32)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from pagedllm.model_executor.layers.cpu_gemm import pack_supported
from pagedllm.platforms import current_platform
from pagedllm.pooling import cpu_mixed
from tests.pooling.conftest import varied_sentences

SENTENCES = varied_sentences(100) + varied_sentences(100, seed=1)


def _gemm_dtype(llm: Any) -> torch.dtype | None:
    return llm.apply_model(lambda m: m.model.gemm_dtype)[0]


@pytest.fixture(scope="module")
def mixed_llm(minilm_dir: str) -> Iterator[Any]:
    if not pack_supported(torch.bfloat16):
        pytest.skip("this oneDNN cannot pack bf16 weights")
    from pagedllm import LLM

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDLLM_CPU_ENCODER_BF16_GEMM", "1")  # also on CPUs without native bf16 (emulated, slower)
        llm = LLM(minilm_dir, dtype="auto", disable_log_stats=True)
    yield llm
    del llm


def test_mixed_matches_sentence_transformers(mixed_llm: Any, minilm_llm: Any, st_model: Any) -> None:
    assert _gemm_dtype(mixed_llm) == torch.bfloat16
    assert mixed_llm.llm_engine.model_config.dtype == torch.float32
    got = torch.tensor([o.outputs.embedding for o in mixed_llm.embed(SENTENCES)])
    ref = st_model.encode(SENTENCES, convert_to_tensor=True, batch_size=32).float()
    cos = torch.nn.functional.cosine_similarity(got, ref, dim=-1)
    assert cos.min().item() >= 0.9999, cos.min().item()
    torch.testing.assert_close(got.norm(dim=-1), torch.ones(len(SENTENCES)), atol=1e-5, rtol=0)
    # The GEMMs really ran in bf16: the float32 engine's vectors differ (by far more than float32 noise).
    exact = torch.tensor([o.outputs.embedding for o in minilm_llm.embed(SENTENCES)])
    assert _gemm_dtype(minilm_llm) is None
    assert (got - exact).abs().max().item() > 1e-5


def test_mixed_batch_and_alone_agree(mixed_llm: Any) -> None:
    batch = torch.tensor([o.outputs.embedding for o in mixed_llm.embed(SENTENCES[:40])])
    for i in (0, 7, 23):
        alone = torch.tensor(mixed_llm.embed([SENTENCES[i]])[0].outputs.embedding)
        assert torch.nn.functional.cosine_similarity(alone, batch[i], dim=0).item() >= 0.99999


@pytest.mark.parametrize("mode", ["auto", "1", "0"])
def test_choice(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    from transformers import BertConfig

    monkeypatch.setenv("PAGEDLLM_CPU_ENCODER_BF16_GEMM", mode)
    fp32, bf16 = BertConfig(torch_dtype="float32"), BertConfig(torch_dtype="bfloat16")
    native = current_platform.cpu_has_native_bf16()
    assert cpu_mixed.choose("auto", fp32, "cpu") == (mode == "1" or (mode == "auto" and native))
    assert cpu_mixed.choose("float32", fp32, "cpu") == (mode == "1")
    assert not cpu_mixed.choose("auto", bf16, "cpu")
    assert not cpu_mixed.choose("bfloat16", fp32, "cpu")
    assert not cpu_mixed.choose("auto", fp32, "cuda")


def test_bad_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDLLM_CPU_ENCODER_BF16_GEMM", "yes")
    with pytest.raises(ValueError, match="PAGEDLLM_CPU_ENCODER_BF16_GEMM"):
        cpu_mixed.choose("auto", None, "cpu")
