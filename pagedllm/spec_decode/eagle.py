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

import copy
from typing import Any

import numpy as np
import torch
from torch import nn

from pagedllm.model_executor.layers.layernorm import RMSNorm
from pagedllm.model_executor.layers.linear import RowParallelLinear
from pagedllm.model_executor.layers.vocab_embedding import VocabParallelEmbedding
from pagedllm.model_executor.model_loader.loader import _default_dtype, get_weights_iterator, resolve_load_format
from pagedllm.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from pagedllm.model_executor.models.llama_attention import get_head_dim
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

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the state the LM head reads, the state fed back to the next step): the same for EAGLE-1."""
        x = self.fc(torch.cat([self.embed_tokens(input_ids), hidden.to(self.fc.weight.dtype)], dim=-1))
        residual: torch.Tensor | None = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        assert residual is not None
        out = x + residual
        return out, out


class _Eagle3Layer(LlamaDecoderLayer):
    """EAGLE-3's `midlayer`: attention over concat(norm(embedding), hidden_norm(hidden)) (2H inputs), the
    hidden state as the residual."""

    def __init__(self, config: Any) -> None:
        h = config.hidden_size
        wide = copy.copy(config)
        wide.hidden_size = 2 * h
        wide.head_dim = get_head_dim(config)
        super().__init__(wide, 0, prefix="eagle3.midlayer")
        self.self_attn.o_proj = RowParallelLinear(self.self_attn.q_size, h, bias=False, prefix="eagle3.o_proj")
        self.self_attn.hidden_size = h
        eps = float(getattr(config, "rms_norm_eps", 1e-6))
        self.mlp = LlamaMLP(h, config.intermediate_size, bias=False, prefix="eagle3.mlp")
        self.input_layernorm = RMSNorm(h, eps=eps)
        self.hidden_norm = RMSNorm(h, eps=eps)
        self.post_attention_layernorm = RMSNorm(h, eps=eps)

    def forward(  # type: ignore[override]
        self, positions: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        x = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(x, hidden)
        return self.mlp(x), residual


class _Eagle3Model(nn.Module):
    def __init__(self, config: Any, target_hidden: int) -> None:
        super().__init__()
        h = config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, h, prefix="model.embed_tokens")
        self.fc = nn.Linear(3 * target_hidden, h, bias=False)
        self.midlayer = _Eagle3Layer(config)
        self.norm = RMSNorm(h, eps=float(getattr(config, "rms_norm_eps", 1e-6)))
        draft_vocab = int(getattr(config, "draft_vocab_size", None) or config.vocab_size)
        self.lm_head = nn.Linear(h, draft_vocab, bias=False)
        self.d2t: torch.Tensor
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.int64))

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.midlayer(positions, self.embed_tokens(input_ids), hidden.to(self.fc.weight.dtype))
        return self.norm(x, residual)  # (normed for the LM head, pre-norm fed back)

    def token_ids(self, normed: torch.Tensor) -> torch.Tensor:
        """Greedy target-vocabulary ids: the draft vocabulary's argmax mapped through d2t (id + offset)."""
        d = self.lm_head(normed).argmax(dim=-1)
        return d + self.d2t[d]


class EagleHead(nn.Module):
    """Holds `model` (the head) for `LlamaForCausalLM.load_weights` (the same name mapping)."""

    def __init__(self, config: Any, eagle3: bool = False, target_hidden: int = 0) -> None:
        super().__init__()
        self.model: Any = _Eagle3Model(config, target_hidden) if eagle3 else _EagleModel(config)
        self.tie_word_embeddings = False

    def load_weights(self, weights: Any) -> set[str]:
        return LlamaForCausalLM.load_weights(self, weights)  # type: ignore[arg-type]


class EagleProposer(DraftModelProposer):
    def __init__(self, config: Any, runner: Any) -> None:
        self.target = runner.model
        self.eagle3 = config.method == "eagle3"
        self._step: tuple[Any, torch.Tensor] | None = None
        self._aux: dict[int, torch.Tensor] = {}
        super().__init__(config, runner)
        if self.eagle3:
            self._hook_aux_layers(runner)

    def _hook_aux_layers(self, runner: Any) -> None:
        """EAGLE-3 reads the residual stream entering three target layers (vLLM's default ids: 2, L // 2,
        L - 3, or the head config's `eagle_aux_hidden_state_layer_ids`), caught by forward pre-hooks; a
        CUDA-graph replay would skip the hooks, so the target runs eagerly."""
        layers = self.target.model.layers
        n = len(layers)
        cfg = self.model.model.config if hasattr(self.model.model, "config") else None
        ids = getattr(cfg, "eagle_aux_hidden_state_layer_ids", None) or (2, n // 2, n - 3)
        self.aux_ids = [int(i) for i in ids]
        for i in self.aux_ids:

            def hook(_m: nn.Module, args: tuple, i: int = i) -> None:
                hidden, residual = args[1], args[2]
                if residual is not None and hidden.dim() > residual.dim():  # a MoE block's unsummed experts
                    hidden = hidden.sum(dim=-2)
                self._aux[i] = hidden if residual is None else hidden + residual

            layers[i].register_forward_pre_hook(hook)
        runner.config.enforce_eager = True

    def _load_model(self, mc: Any, runner: Any) -> Any:
        with _default_dtype(mc.dtype), torch.device(self.device):
            head = EagleHead(mc.hf_config, self.eagle3, int(self.target.config.hidden_size))
        head.model.config = mc.hf_config
        weights = get_weights_iterator(mc, resolve_load_format(mc, "auto"))
        has_embed = False
        loaded_d2t: set[str] = set()

        def renamed() -> Any:
            nonlocal has_embed
            for name, t in weights:
                has_embed = has_embed or name.endswith("embed_tokens.weight")
                if name == "t2d":
                    continue  # the target -> draft mask: d2t alone maps the draft's argmax
                if name == "d2t":
                    head.model.d2t.copy_(t.to(torch.int64))
                    loaded_d2t.add("model.d2t")
                    continue
                yield (name if name.startswith("model.") else f"model.{name}"), t

        with torch.no_grad():
            loaded = head.load_weights(renamed())
            if not has_embed:  # share the target's embedding
                head.model.embed_tokens = self.target.model.embed_tokens
                loaded |= {n for n, _ in head.named_parameters() if "embed_tokens" in n}
        missing = {n for n, _ in head.named_parameters()} - loaded
        if self.eagle3 and not loaded_d2t and head.model.lm_head.out_features != mc.vocab_size:
            missing.add("d2t")
        if missing:
            raise ValueError(f"speculative_config.model: EAGLE checkpoint misses {sorted(missing)[:4]}")
        return head

    def observe(self, x: Any, hidden: torch.Tensor) -> None:
        """The step's inputs and the target's hidden states (the runner calls this after its forward);
        EAGLE-3: the three auxiliary states, concatenated and projected by the head's fc."""
        if self.eagle3:
            hidden = self.model.model.fc(
                torch.cat([self._aux[i] for i in self.aux_ids], dim=-1).to(self.model.model.fc.weight.dtype)
            )
        self._step = (x, hidden)

    def _head(self, hidden_in: torch.Tensor) -> Any:
        return lambda ids, pos: self.model.model(ids, pos, hidden_in)

    def _ids(self, h: torch.Tensor) -> torch.Tensor:
        if self.eagle3:
            return self.model.model.token_ids(h)
        return self.target.compute_logits(h).argmax(dim=-1)

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
            (h_logits, h_feed), last = self._attn_forward(self._head(h_in), tok, positions, nq, hi[idx], table)
            # Proposals for the requests asked for whose last caught-up position is known - 2.
            want = [j for j, i in enumerate(idx.tolist()) if x.req_ids[i] in cap_of and hi[i] == known_all[i] - 1]
            if want:
                w = np.asarray(want)
                sel_last = torch.from_numpy(last[w]).to(dev)
                h_last = h_feed[sel_last]
                cur = self._ids(h_logits[sel_last])
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
                    (h_logits, h_last), _ = self._attn_forward(self._head(h_last), cur, p, ones, p + 1, sub[active])
                    cur = self._ids(h_logits)
                    for a, t in zip(active.tolist(), cur.tolist()):
                        result[a].append(t)
                props = dict(zip(wids, result))
        return [props.get(r, []) for r in req_ids]
