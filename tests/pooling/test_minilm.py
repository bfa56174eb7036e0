"""The real all-MiniLM-L6-v2 against sentence-transformers' own output (acceptance 1), batching
invariance (acceptance 3) and the offline API's checks."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pagedllm import PoolingParams
from pagedllm.outputs import EmbeddingRequestOutput
from tests.pooling.conftest import varied_sentences

SENTENCES = varied_sentences(100)


@pytest.fixture(scope="module")
def embeddings(minilm_llm: Any) -> torch.Tensor:
    outs = minilm_llm.embed(SENTENCES)
    assert all(isinstance(o, EmbeddingRequestOutput) for o in outs)
    return torch.tensor([o.outputs.embedding for o in outs])


def test_embed_matches_sentence_transformers(embeddings: torch.Tensor, st_model: Any) -> None:
    ref = st_model.encode(SENTENCES, convert_to_tensor=True, batch_size=32).float()
    assert embeddings.shape == ref.shape == (len(SENTENCES), 384)
    cos = torch.nn.functional.cosine_similarity(embeddings, ref, dim=-1)
    assert cos.min().item() >= 0.9999, cos.min().item()
    # Normalized, as the checkpoint's Normalize module says.
    torch.testing.assert_close(embeddings.norm(dim=-1), torch.ones(len(SENTENCES)), atol=1e-5, rtol=0)


def test_batch_mixing_long_and_short_equals_one_at_a_time(minilm_llm: Any, embeddings: torch.Tensor) -> None:
    # The module's batch mixes 1-word and 80-word inputs (one step); here a few of them alone.
    lengths = [len(s.split()) for s in SENTENCES]
    picks = [lengths.index(min(lengths)), lengths.index(max(lengths)), 5, 17]
    for i in picks:
        alone = torch.tensor(minilm_llm.embed([SENTENCES[i]])[0].outputs.embedding)
        torch.testing.assert_close(alone, embeddings[i], atol=1e-5, rtol=0)


def test_encode_tasks_and_params(minilm_llm: Any, st_model: Any) -> None:
    text = "A man is playing a guitar."
    raw = minilm_llm.embed([text], PoolingParams(normalize=False))[0].outputs.embedding
    ref = st_model.encode([text], convert_to_tensor=True, normalize_embeddings=False)[0]
    # sentence-transformers' Normalize module is part of this model: compare directions and norm > 1.
    assert torch.tensor(raw).norm() > 1.01
    cos = torch.nn.functional.cosine_similarity(torch.tensor(raw), ref.float(), dim=0)
    assert cos >= 0.9999
    tokens = minilm_llm.encode([text], pooling_task="token_embed")[0]
    n = len(tokens.prompt_token_ids)
    assert tuple(tokens.outputs.data.shape) == (n, 384)
    # Mean of the raw token states == the unnormalized sentence embedding.
    toks = minilm_llm.encode([text], PoolingParams(normalize=False), pooling_task="token_embed")[0].outputs.data
    torch.testing.assert_close(toks.mean(0), torch.tensor(raw), atol=1e-5, rtol=0)


def test_score_by_embedding_similarity(minilm_llm: Any, st_model: Any) -> None:
    q, docs = "A cat sits on the mat.", ["A kitten rests on a rug.", "Stock markets fell sharply today."]
    scores = [o.outputs.score for o in minilm_llm.score(q, docs)]
    e = st_model.encode([q, *docs], convert_to_tensor=True)
    ref = torch.nn.functional.cosine_similarity(e[:1], e[1:]).tolist()
    assert scores == pytest.approx(ref, abs=1e-4)
    assert scores[0] > scores[1]


def test_truncation_and_errors(minilm_llm: Any) -> None:
    long_text = "word " * 400  # > 256 tokens (max_seq_length of the checkpoint)
    with pytest.raises(ValueError, match="maximum context length"):
        minilm_llm.embed([long_text])
    out = minilm_llm.embed([long_text], truncate_prompt_tokens=-1)[0]
    assert len(out.prompt_token_ids) == 256
    out = minilm_llm.embed([long_text], truncate_prompt_tokens=10)[0]
    assert len(out.prompt_token_ids) == 10
    with pytest.raises(ValueError, match="empty"):
        minilm_llm.embed([])
    with pytest.raises(ValueError, match="dimensions"):
        minilm_llm.embed(["x"], PoolingParams(dimensions=16))
    with pytest.raises(ValueError, match="task"):
        minilm_llm.classify(["x"])
    with pytest.raises(ValueError, match="task: .*'generate'"):
        minilm_llm.generate(["x"])
    # The engine still serves after the errors.
    assert len(minilm_llm.embed(["still alive"])[0].outputs.embedding) == 384
