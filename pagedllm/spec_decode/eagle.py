"""EAGLE proposer (EAGLE-1 head layout, as vLLM's `llama_eagle`): a one-layer Llama decoder over
fc(concat(embed(next token), target hidden state)), with no input norm in its first layer, whose output
feeds the target's LM head. The checkpoint layout is the one the EAGLE authors publish: `fc.weight`
(+ `fc.bias`), `layers.0.*` in HF Llama names, optionally `embed_tokens.weight` (else the target's
embedding is shared); no LM head (the target's is used).

Alignment (as vLLM): the head's input at position p is (token p + 1, the target's final hidden state at
p); its output there predicts token p + 2. Per step the head catches up on the positions the target just
computed whose next token is known (accepted proposals included, rejected ones never), which gives the
first proposal; then k - 1 one-token steps feed back the head's own output. The head runs through the
draft-model machinery: its own paged KV cache and block tables."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from pagedllm.model_executor.layers.vocab_embedding import VocabParallelEmbedding
from pagedllm.model_executor.model_loader.loader import _default_dtype, get_weights_iterator, resolve_load_format
from pagedllm.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from pagedllm.spec_decode.draft_model import DraftModelProposer, _DraftState


class _EagleModel(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        h = config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, h, prefix="model.embed_tokens")
        self.fc = nn.Linear(2 * h, h, bias=bool(getattr(config, "bias", True)))
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, prefix=f"eagle.layers.{i}") for i in range(config.num_hidden_layers)
        )
        self.layers[0].input_layernorm = nn.Identity()  # EAGLE-1: no norm before the first layer

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        x = self.fc(torch.cat([self.embed_tokens(input_ids), hidden.to(self.fc.weight.dtype)], dim=-1))
        residual: torch.Tensor | None = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        assert residual is not None
        return x + residual


class EagleHead(nn.Module):
    """Holds `model` (the head) for `LlamaForCausalLM.load_weights` (the same name mapping)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.model = _EagleModel(config)
        self.tie_word_embeddings = False

    def load_weights(self, weights: Any) -> set[str]:
        return LlamaForCausalLM.load_weights(self, weights)  # type: ignore[arg-type]


class EagleProposer(DraftModelProposer):
    def __init__(self, config: Any, runner: Any) -> None:
        self.target = runner.model
        self._step: tuple[Any, torch.Tensor] | None = None
        super().__init__(config, runner)

    def _load_model(self, mc: Any, runner: Any) -> Any:
        with _default_dtype(mc.dtype), torch.device(self.device):
            head = EagleHead(mc.hf_config)
        weights = get_weights_iterator(mc, resolve_load_format(mc, "auto"))
        has_embed = False

        def renamed() -> Any:
            nonlocal has_embed
            for name, t in weights:
                has_embed = has_embed or name.endswith("embed_tokens.weight")
                yield (name if name.startswith("model.") else f"model.{name}"), t

        with torch.no_grad():
            loaded = head.load_weights(renamed())
            if not has_embed:  # share the target's embedding
                head.model.embed_tokens = self.target.model.embed_tokens
                loaded |= {n for n, _ in head.named_parameters() if "embed_tokens" in n}
        missing = {n for n, _ in head.named_parameters()} - loaded
        if missing:
            raise ValueError(f"speculative_config.model: EAGLE checkpoint misses {sorted(missing)[:4]}")
        return head

    def observe(self, x: Any, hidden: torch.Tensor) -> None:
        """The step's inputs and the target's hidden states (the runner calls this after its forward)."""
        self._step = (x, hidden)

    def _head(self, hidden_in: torch.Tensor) -> Any:
        return lambda ids, pos: self.model.model(ids, pos, hidden_in)

    @torch.inference_mode()
    def propose(
        self, req_ids: list[str], token_ids: np.ndarray, rows: list[int], num_tokens: np.ndarray, caps: list[int]
    ) -> list[list[int]]:
        assert self._step is not None
        x, hidden = self._step
        dev = self.device
        known_all = num_tokens[x.rows].astype(np.int64)
        lo = x.computed.astype(np.int64)
        hi = np.minimum(x.seq_lens, known_all - 1)  # positions whose next token is known
        n = np.maximum(hi - lo, 0)
        cap_of = dict(zip(req_ids, caps))
        idx = np.flatnonzero(n > 0)
        props: dict[str, list[int]] = {}
        if len(idx):
            states = [self.states.setdefault(x.req_ids[i], _DraftState()) for i in idx.tolist()]
            for st, i in zip(states, idx.tolist()):
                self._grow(st, int(hi[i]) + cap_of.get(x.req_ids[i], 1))
                st.computed = int(hi[i])
            nq = n[idx]
            starts = np.repeat(lo[idx], nq)
            offs = np.arange(int(nq.sum())) - np.repeat(np.cumsum(nq) - nq, nq)
            positions = starts + offs
            tok = token_ids[np.repeat(x.rows[idx], nq), positions + 1]
            hrows = np.repeat(x.cu[:-1][idx], nq) + offs
            h_in = hidden[torch.from_numpy(hrows).to(dev)]
            table = self._table(states)
            out, last = self._attn_forward(self._head(h_in), tok, positions, nq, hi[idx], table)
            # Proposals for the requests asked for whose last caught-up position is known - 2.
            want = [j for j, i in enumerate(idx.tolist()) if x.req_ids[i] in cap_of and hi[i] == known_all[i] - 1]
            if want:
                w = np.asarray(want)
                h_last = out[torch.from_numpy(last[w]).to(dev)]
                cur = self.target.compute_logits(h_last).argmax(dim=-1)
                wids = [x.req_ids[int(idx[j])] for j in want]
                wcaps = np.asarray([cap_of[r] for r in wids], dtype=np.int64)
                pos = hi[idx][w].astype(np.int64)  # the next position: known - 1
                result = [[t] for t in cur.tolist()]
                sub = table[w]
                active = np.arange(len(w))
                for j in range(1, int(wcaps.max())):
                    keep = wcaps[active] > j
                    active = active[keep]
                    if not len(active):
                        break
                    sel = torch.from_numpy(np.flatnonzero(keep)).to(dev)
                    h_last, cur = h_last[sel], cur[sel]
                    p = pos[active] + j - 1
                    ones = np.ones(len(active), dtype=np.int64)
                    h_last, _ = self._attn_forward(self._head(h_last), cur, p, ones, p + 1, sub[active])
                    cur = self.target.compute_logits(h_last).argmax(dim=-1)
                    for a, t in zip(active.tolist(), cur.tolist()):
                        result[a].append(t)
                props = dict(zip(wids, result))
        return [props.get(r, []) for r in req_ids]
