"""Draft-model proposer: a smaller model with the target's vocabulary proposes k tokens per request by
greedy decoding (a deterministic proposal: the rejection sampler treats it as q = one-hot, which keeps
the target's distribution exact at any temperature, as vLLM's v1 drafters do).

The draft runs through the model runner's machinery (the same attention backend, `attn_inputs` metadata
and forward context) with its own paged KV cache and its own block tables: each request owns draft
blocks from a free list, grown as its tokens grow and freed when it finishes or is preempted. Per step,
one forward catches the draft up on every token it has not seen (a whole prompt the first time, then the
accepted tokens and the new one) and yields the first proposal; k - 1 one-token forwards yield the rest.
KV written for proposals lies beyond the draft's computed tokens and is overwritten by the next step.

On CUDA (not enforce_eager) the draft's decode forwards replay CUDA graphs: the catch-up after a verification
(at most k + 1 new tokens per request) those of k + 1 rows per request, the one-token forwards those of one row:
eagerly, a SmolLM2-shaped draft's ~300 launches per forward made a step of the 8B target ~20x its plain step
(NOTES, session 22)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pagedllm.attention.layer import Attention
from pagedllm.config import build_model_config
from pagedllm.core.kv_cache_utils import KVCacheSpec, group_layers_by_spec
from pagedllm.forward_context import set_forward_context
from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.utils import cdiv
from pagedllm.worker.attn_inputs import build_commons, metadata_by_layer, tables_and_slots

if TYPE_CHECKING:
    from pagedllm.worker.cuda_graph import CudaGraphRunner


@dataclass
class _DraftState:
    blocks: list[int] = field(default_factory=list)
    computed: int = 0
    """Tokens of the request whose draft KV is written (all known ones after each proposal)."""


class DraftModelProposer:
    def __init__(self, config: SpeculativeConfig, runner: Any) -> None:
        assert config.model is not None
        tmc = runner.model_config
        self.k = config.num_speculative_tokens
        self.device: torch.device = runner.device
        self.block_size: int = runner.block_size
        self.max_num_reqs: int = runner.max_num_reqs
        self.use_graphs = self.device.type == "cuda" and not runner.config.enforce_eager
        self.graphs: CudaGraphRunner | None = None
        """One row per request (the one-token forwards), set by `capture_graphs`."""
        self.catchup_graphs: CudaGraphRunner | None = None
        """k + 1 rows per request (the catch-up forwards after a verification)."""
        mc = build_model_config(
            model=config.model,
            tokenizer=None,
            tokenizer_mode="auto",
            skip_tokenizer_init=True,
            dtype=tmc.dtype,
            seed=tmc.seed,
            max_model_len=config.max_model_len or tmc.max_model_len,
            revision=None,
            hf_overrides=None,
            generation_config="vllm",
            max_logprobs=0,
            device=self.device.type,
            load_format=runner.config.load_config.load_format,
            quantization=config.quantization,
        )
        if mc.vocab_size != tmc.vocab_size:
            raise ValueError(
                f"speculative_config.model: the draft's vocabulary has {mc.vocab_size} tokens, the target's "
                f"{tmc.vocab_size}; a draft model must share the target's vocabulary"
            )
        if mc.max_model_len < tmc.max_model_len:
            raise ValueError(
                f"speculative_config.model: the draft's max_model_len ({mc.max_model_len}) is below the target's "
                f"({tmc.max_model_len})"
            )
        self.max_model_len: int = mc.max_model_len
        self.model: Any = self._load_model(mc, runner)
        self.model.eval()
        self.layers = {m.layer_name: m for m in self.model.modules() if isinstance(m, Attention)}
        self.specs = {
            n: KVCacheSpec(self.block_size, m.num_kv_heads, m.head_size, mc.dtype, m.sliding_window)
            for n, m in self.layers.items()
            if m.attn_type == "decoder"
        }
        self.groups = group_layers_by_spec(self.specs)
        self.builders: list = []
        self.free: list[int] = []
        self.states: dict[str, _DraftState] = {}

    def _load_model(self, mc: Any, runner: Any) -> Any:
        from pagedllm.model_executor.model_loader.loader import load_model

        return load_model(mc, runner.config.load_config.load_format, self.device)

    def bytes_per_block(self) -> int:
        return sum(s.page_size_bytes for s in self.specs.values())

    def initialize_kv_cache(self, num_target_blocks: int, alloc_zeroed: Any) -> None:
        """As many token slots as the target's cache, plus each request's proposal slack."""
        n = num_target_blocks + self.max_num_reqs * (cdiv(self.k, self.block_size) + 1)
        for name, spec in self.specs.items():
            layer = self.layers[name]
            shape = layer.backend.get_kv_cache_shape(n, spec.block_size, spec.num_kv_heads, spec.head_size)
            layer.kv_cache = alloc_zeroed(shape, spec.dtype, self.device)
        backend = next(iter(self.layers.values())).backend
        self.builders = [
            backend.get_builder_cls()(g.spec.block_size, g.spec.sliding_window, self.device) for g in self.groups
        ]
        self.free = list(range(n - 1, 0, -1))  # block 0 stays unused (the null block, as the target's pool)

    def capture_graphs(self, pool: Any = None) -> None:
        """After `initialize_kv_cache`: the decode graphs (CUDA, not enforce_eager)."""
        if not self.use_graphs:
            return
        from pagedllm.worker.cuda_graph import CudaGraphRunner

        mml = self.max_model_len + self.k + 1  # (proposal rows reach up to k past the known tokens)
        blocks = cdiv(mml, self.block_size)
        args = (self.model, self.groups, self.builders, self.max_num_reqs, blocks, mml, self.device)
        self.graphs = CudaGraphRunner(*args, pool=pool)
        self.graphs.capture()
        self.catchup_graphs = CudaGraphRunner(*args, query_len=self.k + 1, pool=self.graphs.pool)
        self.catchup_graphs.capture()

    def release_graphs(self) -> None:
        self.graphs = self.catchup_graphs = None

    def drop(self, req_id: str) -> None:
        st = self.states.pop(req_id, None)
        if st is not None:
            self.free.extend(st.blocks)

    def _grow(self, st: _DraftState, num_slots: int) -> None:
        need = cdiv(num_slots, self.block_size) - len(st.blocks)
        if need > len(self.free):
            raise RuntimeError("draft KV cache exhausted (it is sized to the target's cache plus k per request)")
        for _ in range(need):
            st.blocks.append(self.free.pop())

    def _attn_forward(
        self,
        fn: Any,
        ids: np.ndarray | torch.Tensor,
        positions: np.ndarray,
        n_query: np.ndarray,
        seq_lens: np.ndarray,
        table: np.ndarray,
    ) -> tuple[torch.Tensor, np.ndarray]:
        """`fn(input_ids, positions)` under the draft's attention metadata: (its output, the index of each
        request's last query token)."""
        b = len(n_query)
        cu = np.zeros(b + 1, dtype=np.int64)
        np.cumsum(n_query, out=cu[1:])
        req_of_token = np.repeat(np.arange(b), n_query)
        bs = [g.spec.block_size for g in self.groups]
        tables, slots = tables_and_slots(
            [table] * len(self.groups), bs, np.arange(b), req_of_token, positions, int(seq_lens.max())
        )
        dev = self.device
        commons = build_commons(cu, seq_lens, seq_lens - n_query, tables, slots, int(n_query.max()), dev)
        ids_t = ids.to(dev) if isinstance(ids, torch.Tensor) else torch.from_numpy(ids).to(dev)
        with set_forward_context(metadata_by_layer(self.builders, self.groups, commons)):
            out = fn(ids_t, torch.from_numpy(positions).to(dev))
        return out, cu[1:] - 1

    def _forward(
        self, ids: np.ndarray, positions: np.ndarray, n_query: np.ndarray, seq_lens: np.ndarray, table: np.ndarray
    ) -> torch.Tensor:
        """Greedy next token after each request's last query token."""
        hidden = self._replay(ids, positions, n_query, seq_lens, table)
        if hidden is not None:
            last = np.cumsum(n_query) - 1
        else:
            hidden, last = self._attn_forward(self.model, ids, positions, n_query, seq_lens, table)
        return self.model.compute_logits(hidden[torch.from_numpy(last).to(self.device)]).argmax(dim=-1)

    def _replay(
        self, ids: np.ndarray, positions: np.ndarray, n_query: np.ndarray, seq_lens: np.ndarray, table: np.ndarray
    ) -> torch.Tensor | None:
        """The forward's hidden states (every query row, flat) from a decode graph, or None where none fits."""
        b = len(n_query)
        q_max = int(n_query.max())
        g = self.graphs if q_max == 1 else self.catchup_graphs
        cu = np.zeros(b + 1, dtype=np.int64)
        np.cumsum(n_query, out=cu[1:])
        if g is None or q_max > g.q or not g.can_run(b) or (q_max > 1 and not g.can_run_padded(cu, seq_lens)):
            return None
        bs = [gr.spec.block_size for gr in self.groups]
        req_of_token = np.repeat(np.arange(b), n_query)
        # (q-row graphs: the padded rows' keys reach q - 1 past a request's own; their outputs are dropped)
        width = int(seq_lens.max()) + (g.q if q_max > 1 else 0)
        tables, slots = tables_and_slots([table] * len(self.groups), bs, np.arange(b), req_of_token, positions, width)
        if q_max == 1:
            return g.run(ids, positions, seq_lens.astype(np.int32), slots, tables)
        return g.run_padded(ids, seq_lens, cu, slots, tables)

    def _table(self, states: list[_DraftState]) -> np.ndarray:
        width = max(len(st.blocks) for st in states)
        table = np.zeros((len(states), max(width, 1)), dtype=np.int32)
        for i, st in enumerate(states):
            table[i, : len(st.blocks)] = st.blocks
        return table

    @torch.inference_mode()
    def propose(
        self, req_ids: list[str], token_ids: np.ndarray, rows: list[int], num_tokens: np.ndarray, caps: list[int]
    ) -> list[list[int]]:
        states = [self.states.setdefault(r, _DraftState()) for r in req_ids]
        rows_np = np.asarray(rows, dtype=np.int64)
        known = num_tokens[rows_np].astype(np.int64)
        caps_np = np.asarray(caps, dtype=np.int64)
        start = np.array([st.computed for st in states], dtype=np.int64)
        for st, n, c in zip(states, known.tolist(), caps):
            self._grow(st, n + c - 1)
        table = self._table(states)
        # Catch up on every unseen token; the first proposal comes from the last one.
        n_query = known - start
        req_of_token = np.repeat(np.arange(len(states)), n_query)
        positions = (
            np.repeat(start, n_query) + np.arange(int(n_query.sum())) - np.repeat(np.cumsum(n_query) - n_query, n_query)
        )
        ids = token_ids[rows_np[req_of_token], positions]
        tok = self._forward(ids, positions, n_query, known, table)
        for st, n in zip(states, known.tolist()):
            st.computed = n
        last = tok.cpu().numpy()
        props = [[t] for t in last.tolist()]
        for j in range(1, int(caps_np.max())):
            active = np.flatnonzero(caps_np > j)
            if not len(active):
                break
            pos = known[active] + j - 1
            ones = np.ones(len(active), dtype=np.int64)
            step = self._forward(last[active], pos, ones, pos + 1, table[active]).cpu().numpy()
            last[active] = step
            for a, t in zip(active.tolist(), step.tolist()):
                props[a].append(t)
        return props
