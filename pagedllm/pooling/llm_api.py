"""`LLM.embed / classify / score / reward / encode` (vLLM's offline pooling API), mixed into `LLM`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.nn.functional as F

from pagedllm.inputs import PromptType, TokensPrompt
from pagedllm.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    ScoringRequestOutput,
)
from pagedllm.pooling_params import PoolingParams


def pair_token_ids(tokenizer: Any, text_1: str, text_2: str, truncate: int | None, max_len: int) -> list[int]:
    """A cross-encoder's input: the tokenizer's text pair ([CLS] a [SEP] b [SEP] for BERT)."""
    kw: dict[str, Any] = {}
    if truncate is not None:
        kw = {"truncation": True, "max_length": max_len if truncate == -1 else min(truncate, max_len)}
    return list(tokenizer(text_1, text_2, **kw)["input_ids"])


def score_pairs(data_1: Any, data_2: Any) -> list[tuple[Any, Any]]:
    """vLLM's pairing: one item against many, or two lists of the same length element-wise."""
    d1 = [data_1] if isinstance(data_1, (str, dict)) else list(data_1)
    d2 = [data_2] if isinstance(data_2, (str, dict)) else list(data_2)
    if not d1 or not d2:
        raise ValueError("score: the inputs must not be empty")
    if len(d1) == 1:
        d1 = d1 * len(d2)
    if len(d1) != len(d2):
        raise ValueError(f"score: got {len(d1)} first inputs and {len(d2)} second inputs (need 1:N or N:N)")
    return list(zip(d1, d2))


class LLMPoolingMixin:
    """Needs `self.llm_engine`, `self._counter`, `self._run_engine` and `self._check_can_run` (from `LLM`)."""

    llm_engine: Any
    _counter: Any

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
        pooling_task: str | None = None,
    ) -> list[PoolingRequestOutput]:
        """Pool each prompt for `pooling_task` (default: the model's first task: embed or classify)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if not prompts:
            raise ValueError("prompts: the input list is empty")
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            params = [pooling_params or PoolingParams()] * len(prompts)
        else:
            params = list(pooling_params)
            if len(params) != len(prompts):
                raise ValueError(f"pooling_params: got {len(params)} PoolingParams for {len(prompts)} prompts")
        changes: dict[str, Any] = {}
        if pooling_task is not None:
            changes["task"] = pooling_task
        if truncate_prompt_tokens is not None:
            changes["truncate_prompt_tokens"] = truncate_prompt_tokens
        if changes:
            params = [p.clone(**changes) for p in params]
        self._check_can_run()  # type: ignore[attr-defined]
        engine = self.llm_engine
        texts = [p for p in prompts if isinstance(p, str)]
        if engine.tokenizer is not None and len(texts) == len(prompts):
            # One batched tokenizer call (the fast tokenizer's batch path) instead of one per prompt.
            ids = engine.tokenizer(texts)["input_ids"]
            prompts = [TokensPrompt(prompt_token_ids=list(i), prompt=t) for t, i in zip(texts, ids)]
        rids: list[str] = []
        try:
            for p, pp in zip(prompts, params):
                rid = str(next(self._counter))
                engine.add_request(rid, p, pp)
                rids.append(rid)
        except BaseException:
            engine.abort_request(rids)
            raise
        return self._run_engine(rids, False)  # type: ignore[attr-defined]

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        outs = self.encode(prompts, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens, pooling_task="embed")
        return [EmbeddingRequestOutput.from_base(o) for o in outs]

    def classify(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
    ) -> list[ClassificationRequestOutput]:
        outs = self.encode(
            prompts, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens, pooling_task="classify"
        )
        return [ClassificationRequestOutput.from_base(o) for o in outs]

    def reward(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
    ) -> list[PoolingRequestOutput]:
        """Reward models here are sequence classifiers (num_labels reward heads, e.g. *ForSequenceClassification
        reward models): the raw head output, no activation."""
        return self.encode(
            prompts, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens, pooling_task="reward"
        )

    def score(
        self,
        data_1: str | Sequence[str],
        data_2: str | Sequence[str],
        /,
        *,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> list[ScoringRequestOutput]:
        """Cross-encoders (classification models): the model's score of each text pair (sigmoid of the one
        logit unless `use_activation=False`). Embedding models: the cosine similarity of the embeddings."""
        pairs = score_pairs(data_1, data_2)
        mc = self.llm_engine.model_config
        pp = pooling_params or PoolingParams()
        if "score" in mc.pooling.tasks if mc.pooling is not None else False:
            tok = self.llm_engine.get_tokenizer()
            prompts: list[PromptType] = [
                TokensPrompt(prompt_token_ids=pair_token_ids(tok, a, b, truncate_prompt_tokens, mc.max_model_len))
                for a, b in pairs
            ]
            outs = self.encode(prompts, pp, pooling_task="score")
            return [ScoringRequestOutput.from_base(o) for o in outs]
        texts = [a for a, _ in pairs] + [b for _, b in pairs]
        embs = self.encode(texts, pp, truncate_prompt_tokens=truncate_prompt_tokens, pooling_task="embed")
        n = len(pairs)
        results = []
        for i in range(n):
            a, b = embs[i], embs[n + i]
            sim = F.cosine_similarity(a.outputs.data[None].float(), b.outputs.data[None].float()).reshape(1)
            base = PoolingRequestOutput(
                f"{a.request_id}_{b.request_id}", PoolingOutput(sim), a.prompt_token_ids + b.prompt_token_ids
            )
            results.append(ScoringRequestOutput.from_base(base))
        return results
