"""`convert="classify"`: a decoder-only LM class plus a `score` head (HF's *ForSequenceClassification
layout: `model.*` + `score.weight`), pooled on the last token. The LM head is not in such checkpoints: it
stays unused (and unloaded)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagedllm.model_executor.layers.linear import ReplicatedLinear


def as_sequence_classifier(model_cls: type[nn.Module]) -> type[nn.Module]:
    class SequenceClassifier(model_cls):  # type: ignore[valid-type, misc]
        def __init__(self, hf_config: Any, prefix: str = "") -> None:
            super().__init__(hf_config=hf_config, prefix=prefix)
            self.score = ReplicatedLinear(hf_config.hidden_size, hf_config.num_labels, bias=False, prefix="score")

        def classify(self, pooled: torch.Tensor) -> torch.Tensor:
            return self.score(pooled)

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
            score: list[torch.Tensor] = []

            def rest() -> Iterable[tuple[str, torch.Tensor]]:
                for name, t in weights:
                    if name == "score.weight":
                        score.append(t)
                    else:
                        yield name, t

            loaded = set(super().load_weights(rest()))
            if score:
                self.score.weight.data.copy_(score[0])
                loaded.add("score.weight")
            # The LM head has no weights in a classifier checkpoint: count it as loaded (never used).
            loaded.update(n for n, _ in self.named_parameters() if n.startswith("lm_head."))
            return loaded

    SequenceClassifier.__name__ = model_cls.__name__.replace("ForCausalLM", "ForSequenceClassification")
    return SequenceClassifier
