"""Prompt logprobs: the logprobs of each prompt token given the tokens before it, gathered chunk by chunk
as a (possibly chunked) prefill computes the prompt's hidden states."""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.logprobs import LogprobsLists
from pagedllm.model_executor.models.interfaces import CausalLM
from pagedllm.sample.logprobs_gather import gather_logprobs
from pagedllm.worker.input_batch import CachedRequestState, InputBatch

CHUNK = 512
"""Prompt positions whose [positions, vocab] logits are held at once."""


class PromptLogprobs:
    """The requests whose prompt logprobs are not complete yet -> what their chunks so far gave."""

    def __init__(self, logprobs_mode: str) -> None:
        self.logprobs_mode = logprobs_mode
        self.pending: dict[str, LogprobsLists] = {}

    def add(self, st: CachedRequestState) -> None:
        if st.sampling_params.prompt_logprobs is not None and not st.output_token_ids:
            self.pending[st.req_id] = LogprobsLists()

    def remove(self, req_id: str) -> None:
        self.pending.pop(req_id, None)

    def gather(
        self,
        model: CausalLM,
        batch: InputBatch,
        req_ids: list[str],
        rows: np.ndarray,
        computed: np.ndarray,
        seq_lens: np.ndarray,
        cu: np.ndarray,
        hidden: torch.Tensor,
    ) -> dict[str, LogprobsLists]:
        """Logprobs of the prompt tokens this step's chunks predict (position p predicts token p + 1; the
        last prompt position predicts the first output token, which the sampler handles). Returns the
        requests whose prompt logprobs became complete this step."""
        done: dict[str, LogprobsLists] = {}
        if not self.pending:
            return done
        for i, rid in enumerate(req_ids):
            acc = self.pending.get(rid)
            if acc is None:
                continue
            row = int(rows[i])
            st = batch.states[row]
            assert st is not None
            n_prompt = len(st.prompt_token_ids)
            start, end = int(computed[i]), min(int(seq_lens[i]), n_prompt - 1)
            if start == 0:
                acc = self.pending[rid] = LogprobsLists()  # (re)started from scratch
            sp = st.sampling_params
            k = sp.prompt_logprobs if sp.prompt_logprobs is not None else 0
            extra = list(sp.logprob_token_ids or ())
            for a in range(start, end, CHUNK):
                b = min(end, a + CHUNK)
                h_idx = torch.arange(int(cu[i]) + a - start, int(cu[i]) + b - start, device=hidden.device)
                logits = model.compute_logits(hidden[h_idx]).float()
                lp = logits if self.logprobs_mode == "raw_logits" else logits.log_softmax(dim=-1)
                targets = torch.from_numpy(batch.token_ids[row, a + 1 : b + 1].copy()).to(lp.device)
                acc.extend(gather_logprobs(lp, [k] * (b - a), targets, [extra] * (b - a)))
            if int(seq_lens[i]) >= n_prompt:
                done[rid] = self.pending.pop(rid)
        return done
