"""RoBERTa and XLM-RoBERTa encoders (`XLMRobertaModel` is bge-m3's shape; `...ForSequenceClassification`
are the bge-reranker-style cross-encoders) on the BERT encoder (`bert.py`): the same blocks, with two
differences. Position ids start at `pad_token_id + 1` (HF builds them from the non-padding mask, which for
an unpadded sequence is `padding_idx + 1 + i`), so the usable length is `max_position_embeddings -
pad_token_id - 1`; and the classification head is RoBERTa's (dense + tanh + out_proj on the first token)
instead of BERT's pooler. There is one token type, so a text pair is told apart by its separators only."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagedllm.model_executor.layers.linear import ReplicatedLinear
from pagedllm.model_executor.models.bert import BertEncoderModel, BertModel, EncoderBatch, _rename
from pagedllm.model_executor.models.learned_pos import load_renamed


def position_offset(hf_config: Any) -> int:
    """How far RoBERTa's position ids are shifted: `pad_token_id + 1` (2 for the usual pad id 1)."""
    return int(getattr(hf_config, "pad_token_id", 1) or 0) + 1


def _encoder(hf_config: Any) -> BertEncoderModel:
    enc = BertEncoderModel(hf_config, with_pooler=False)
    enc.position_offset = position_offset(hf_config)
    return enc


def _roberta_rename(name: str, t: torch.Tensor) -> tuple[str, torch.Tensor, Any] | None:
    if name.startswith(("pooler.", "roberta.pooler.", "lm_head.")):
        return None  # HF's pooler / MLM head: not used by the embedder or the RoBERTa classifier
    r = _rename(name, "roberta.")
    return None if r is None else (f"model.{r[0]}", t, r[1])


class XLMRobertaModel(BertModel):
    """An embedder: last hidden states to the pooler (bge-m3: CLS pooling + normalize)."""

    def __init__(self, hf_config: Any, prefix: str = "") -> None:
        super().__init__(hf_config, prefix)
        self.model.position_offset = position_offset(hf_config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_renamed(self, weights, _roberta_rename)


class XLMRobertaForSequenceClassification(nn.Module):
    """A cross-encoder / classifier with RoBERTa's head: `classifier.dense` + tanh + `classifier.out_proj`
    on the first token's last hidden state."""

    is_encoder_only = True
    default_pooling_type = "CLS"

    def __init__(self, hf_config: Any, prefix: str = "") -> None:
        super().__init__()
        self.config = hf_config
        self.model = _encoder(hf_config)
        hidden = hf_config.hidden_size
        self.dense = ReplicatedLinear(hidden, hidden, bias=True, prefix="classifier.dense")
        self.out_proj = ReplicatedLinear(hidden, hf_config.num_labels, bias=True, prefix="classifier.out_proj")

    @property
    def num_labels(self) -> int:
        return int(self.config.num_labels)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, eb: EncoderBatch) -> torch.Tensor:
        return self.model(input_ids, positions, eb)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """[N, hidden] first-token hidden states -> [N, num_labels] logits."""
        return self.out_proj(torch.tanh(self.dense(pooled)))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def rename(name: str, t: torch.Tensor) -> tuple[str, torch.Tensor, Any] | None:
            if name.startswith("classifier."):
                return name[len("classifier.") :], t, None
            return _roberta_rename(name, t)

        return load_renamed(self, weights, rename)


class RobertaModel(XLMRobertaModel):
    """RoBERTa proper: the same layout and names."""


class RobertaForSequenceClassification(XLMRobertaForSequenceClassification):
    """RoBERTa proper: the same layout and names."""
