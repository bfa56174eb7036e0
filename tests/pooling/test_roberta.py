"""XLM-RoBERTa / RoBERTa encoders (bge-m3 and bge-reranker shapes) against HF transformers on tiny random
checkpoints: embeddings (first-token pooling, normalized) and cross-encoder / classifier logits, with
RoBERTa's shifted position ids and its dense + tanh + out_proj classification head."""

from __future__ import annotations

import os
import shutil
from typing import Any

import pytest
import torch

from pagedllm import LLM, PoolingParams
from tests.pooling.conftest import TOKENIZER_FILES

TEXTS = ["a short one", "a somewhat longer sentence about cats and dogs, with punctuation!", "x " * 60]
PAIRS = [("what is a cat?", "A cat is a small feline."), ("capital of France", "Paris"), ("q", "d " * 40)]


def _save(out_dir: str, minilm_dir: str, num_labels: int | None, seed: int) -> Any:
    """A random XLM-R (MiniLM's WordPiece tokenizer: pad id 0, so positions start at 1) with non-trivial
    biases and norms, and a scaled classifier so that loading mistakes show."""
    from transformers import XLMRobertaConfig, XLMRobertaForSequenceClassification, XLMRobertaModel

    torch.manual_seed(seed)
    cfg = XLMRobertaConfig(
        vocab_size=30522,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=130,
        type_vocab_size=1,
        pad_token_id=0,
        bos_token_id=101,
        eos_token_id=102,
    )
    if num_labels is None:
        cfg.architectures = ["XLMRobertaModel"]
        model = XLMRobertaModel(cfg, add_pooling_layer=True)
    else:
        cfg.num_labels, cfg.architectures = num_labels, ["XLMRobertaForSequenceClassification"]
        model = XLMRobertaForSequenceClassification(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias") or "LayerNorm" in name:
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "LayerNorm.weight" in name else 0.0))
            elif name == "classifier.out_proj.weight":
                p.mul_(10.0)
    model.eval().save_pretrained(out_dir, safe_serialization=True)
    for f in TOKENIZER_FILES:
        shutil.copy(os.path.join(minilm_dir, f), out_dir)
    return model


@pytest.fixture(scope="module")
def xlmr(tmp_path_factory: pytest.TempPathFactory, minilm_dir: str) -> dict[str, tuple[Any, str]]:
    out = {}
    for key, labels, seed in (("embed", None, 4), ("cls3", 3, 5), ("cross", 1, 6)):
        d = str(tmp_path_factory.mktemp(f"xlmr_{key}"))
        out[key] = (_save(d, minilm_dir, labels, seed), d)
    return out


def _enc(d: str, a: list[str], b: list[str] | None = None) -> dict[str, torch.Tensor]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(d)
    enc = tok(a, b, padding=True, return_tensors="pt") if b is not None else tok(a, padding=True, return_tensors="pt")
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}  # one token type


def test_xlmr_embed_matches_hf(xlmr: dict[str, tuple[Any, str]]) -> None:
    hf, d = xlmr["embed"]
    llm = LLM(d, dtype="float32", disable_log_stats=True)
    assert llm.llm_engine.model_config.max_model_len == 129  # 130 positions, pad id 0: ids 1..129
    with torch.no_grad():
        h = hf(**_enc(d, TEXTS)).last_hidden_state[:, 0].float()
    ref = torch.nn.functional.normalize(h, dim=-1)
    got = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS)])
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
    # Batch of mixed lengths = one at a time.
    one = torch.tensor([llm.embed([t])[0].outputs.embedding for t in TEXTS])
    torch.testing.assert_close(one, got, atol=1e-5, rtol=0)
    del llm


def test_xlmr_classify_and_score_match_hf(xlmr: dict[str, tuple[Any, str]]) -> None:
    hf3, d3 = xlmr["cls3"]
    llm3 = LLM(d3, dtype="float32", disable_log_stats=True)
    with torch.no_grad():
        ref = hf3(**_enc(d3, TEXTS)).logits.float()
    raw = torch.tensor([o.outputs.probs for o in llm3.classify(TEXTS, PoolingParams(use_activation=False))])
    torch.testing.assert_close(raw, ref, atol=1e-4, rtol=0)
    del llm3
    hf1, d1 = xlmr["cross"]
    llm1 = LLM(d1, dtype="float32", disable_log_stats=True)
    a, b = [p[0] for p in PAIRS], [p[1] for p in PAIRS]
    with torch.no_grad():
        ref1 = hf1(**_enc(d1, a, b)).logits.float()[:, 0]
    scores = torch.tensor([o.outputs.score for o in llm1.score(a, b)])
    torch.testing.assert_close(scores, ref1.sigmoid(), atol=1e-4, rtol=0)
    del llm1
