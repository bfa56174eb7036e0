"""Tiny random checkpoints against HF transformers (acceptance 2): BERT cross-encoders / classifiers vs
`AutoModelForSequenceClassification`, a Qwen3 LM as an embedder (`convert="embed"`) vs HF's last-token
hidden state normalized, and as a classifier (`convert="classify"`) vs `Qwen3ForSequenceClassification`."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pagedllm import LLM, PoolingParams
from pagedllm.inputs import TokensPrompt
from tests.utils_model import make_tiny_hf_model

TEXTS = ["a short one", "a somewhat longer sentence about cats and dogs, with punctuation!", "x " * 60]
PAIRS = [("what is a cat?", "A cat is a small feline."), ("capital of France", "Paris"), ("q", "d " * 40)]


@pytest.fixture(scope="module")
def bert_llms(tiny_bert_cls: tuple[Any, Any, Any]) -> tuple[Any, Any]:
    _, _, (d3, d1) = tiny_bert_cls
    return LLM(d3, dtype="float32", disable_log_stats=True), LLM(d1, dtype="float32", disable_log_stats=True)


def _hf_logits(model: Any, tok: Any, a: list[str], b: list[str] | None = None) -> torch.Tensor:
    enc = tok(a, b, padding=True, return_tensors="pt") if b is not None else tok(a, padding=True, return_tensors="pt")
    with torch.no_grad():
        return model(**enc).logits.float()


def test_bert_classify_matches_hf(tiny_bert_cls: tuple[Any, Any, Any], bert_llms: tuple[Any, Any]) -> None:
    from transformers import AutoTokenizer

    hf3, _, (d3, _) = tiny_bert_cls
    llm3, _ = bert_llms
    tok = AutoTokenizer.from_pretrained(d3)
    ref = _hf_logits(hf3, tok, TEXTS)
    raw = torch.tensor([o.outputs.probs for o in llm3.classify(TEXTS, PoolingParams(use_activation=False))])
    torch.testing.assert_close(raw, ref, atol=1e-4, rtol=0)
    probs = torch.tensor([o.outputs.probs for o in llm3.classify(TEXTS)])
    torch.testing.assert_close(probs, ref.softmax(-1), atol=1e-4, rtol=0)
    rewards = torch.stack([o.outputs.data for o in llm3.reward(TEXTS)])
    torch.testing.assert_close(rewards, ref, atol=1e-4, rtol=0)


def test_bert_cross_encoder_score_matches_hf(tiny_bert_cls: tuple[Any, Any, Any], bert_llms: tuple[Any, Any]) -> None:
    from transformers import AutoTokenizer

    _, hf1, (_, d1) = tiny_bert_cls
    _, llm1 = bert_llms
    tok = AutoTokenizer.from_pretrained(d1)
    a, b = [p[0] for p in PAIRS], [p[1] for p in PAIRS]
    ref = _hf_logits(hf1, tok, a, b)[:, 0]  # token_type_ids of the pair included
    raw = torch.tensor([o.outputs.score for o in llm1.score(a, b, pooling_params=PoolingParams(use_activation=False))])
    torch.testing.assert_close(raw, ref, atol=1e-4, rtol=0)
    scores = torch.tensor([o.outputs.score for o in llm1.score(a, b)])
    torch.testing.assert_close(scores, ref.sigmoid(), atol=1e-4, rtol=0)
    # 1:N pairing (one query, several documents).
    one = [o.outputs.score for o in llm1.score(a[0], b)]
    assert one[0] == pytest.approx(scores[0].item(), abs=1e-5)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, str]:
    d = str(tmp_path_factory.mktemp("qwen3_embed"))
    return make_tiny_hf_model("qwen3", d), d


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


def test_qwen3_as_embedder_matches_hf_last_token(qwen3: tuple[Any, str]) -> None:
    hf, d = qwen3
    prompts = [_ids(n, s) for s, n in enumerate((3, 17, 40, 70))]
    # A small step budget so the 70-token prompt is chunked (its KV of earlier chunks is attended to).
    llm = LLM(
        d, dtype="float32", skip_tokenizer_init=True, convert="embed", max_num_batched_tokens=32, disable_log_stats=True
    )
    outs = llm.embed([TokensPrompt(prompt_token_ids=p) for p in prompts])
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            h = hf.model(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long)).last_hidden_state
        ref = torch.nn.functional.normalize(h[0, -1].float(), dim=-1)
        torch.testing.assert_close(torch.tensor(o.outputs.embedding), ref, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="'generate'"):
        llm.generate([TokensPrompt(prompt_token_ids=prompts[0])])
    del llm


def test_qwen3_as_classifier_matches_hf(tmp_path_factory: pytest.TempPathFactory) -> None:
    from transformers import Qwen3ForSequenceClassification

    from tests.utils_model import tiny_hf_config

    d = str(tmp_path_factory.mktemp("qwen3_cls"))
    torch.manual_seed(3)
    cfg = tiny_hf_config("qwen3")
    cfg.num_labels, cfg.pad_token_id, cfg.architectures = 2, 0, ["Qwen3ForSequenceClassification"]
    hf = Qwen3ForSequenceClassification(cfg).eval()
    with torch.no_grad():
        hf.score.weight.mul_(10.0)
    hf.save_pretrained(d, safe_serialization=True)
    llm = LLM(d, dtype="float32", skip_tokenizer_init=True, disable_log_stats=True)
    prompts = [[5 + i for i in range(n)] for n in (4, 21)]
    outs = llm.classify([TokensPrompt(prompt_token_ids=p) for p in prompts], PoolingParams(use_activation=False))
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            ref = hf(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long)).logits[0].float()
        torch.testing.assert_close(torch.tensor(o.outputs.probs), ref, atol=1e-4, rtol=0)
    del llm
