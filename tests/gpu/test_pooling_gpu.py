"""Pooling models on the GPU (issue 22): tiny random BERT embedder / classifier and a Qwen3 embedder
(`convert="embed"`, paged attention path) in float32 on CUDA against HF transformers on the CPU."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from pagedllm import LLM, PoolingParams, TokensPrompt  # noqa: E402
from tests.utils_model import make_tiny_hf_model  # noqa: E402

PROMPTS = [[101, *range(1000, 1000 + n), 102] for n in (3, 30, 100)]


def _bert(tmp_path: Any, num_labels: int | None) -> Any:
    from transformers import AutoModel, AutoModelForSequenceClassification, BertConfig

    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128
    )
    cfg.architectures = ["BertForSequenceClassification" if num_labels else "BertModel"]
    if num_labels:
        cfg.num_labels = num_labels
        model = AutoModelForSequenceClassification.from_config(cfg, attn_implementation="eager")
    else:
        model = AutoModel.from_config(cfg, attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn_like(p) * 0.1)
    model.eval().save_pretrained(str(tmp_path), safe_serialization=True)
    return model


def _engine(d: Any, **kw: Any) -> LLM:
    return LLM(str(d), dtype="float32", device="cuda", skip_tokenizer_init=True, disable_log_stats=True, **kw)


def test_bert_embed_and_classify_on_gpu(tmp_path: Any) -> None:
    hf = _bert(tmp_path / "emb", None)
    llm = _engine(tmp_path / "emb")
    outs = llm.embed([TokensPrompt(prompt_token_ids=p) for p in PROMPTS])
    for p, o in zip(PROMPTS, outs):
        with torch.no_grad():
            h = hf(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long)).last_hidden_state
        ref = torch.nn.functional.normalize(h[0, 0], dim=-1)  # BertModel without ST files: CLS, normalized
        torch.testing.assert_close(torch.tensor(o.outputs.embedding), ref, atol=1e-4, rtol=0)
    del llm
    hf = _bert(tmp_path / "cls", 3)
    llm = _engine(tmp_path / "cls")
    outs = llm.classify([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], PoolingParams(use_activation=False))
    for p, o in zip(PROMPTS, outs):
        with torch.no_grad():
            ref = hf(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long)).logits[0]
        torch.testing.assert_close(torch.tensor(o.outputs.probs), ref, atol=1e-4, rtol=0)
    del llm


def test_qwen3_embedder_on_gpu(tmp_path: Any) -> None:
    hf = make_tiny_hf_model("qwen3", tmp_path)
    llm = _engine(tmp_path, convert="embed", max_num_batched_tokens=64)
    prompts = [[(7 * i + n) % 256 for i in range(n)] for n in (5, 50, 130)]
    outs = llm.embed([TokensPrompt(prompt_token_ids=p) for p in prompts])
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            h = hf.model(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long)).last_hidden_state
        ref = torch.nn.functional.normalize(h[0, -1], dim=-1)
        torch.testing.assert_close(torch.tensor(o.outputs.embedding), ref, atol=1e-4, rtol=0)
    del llm
