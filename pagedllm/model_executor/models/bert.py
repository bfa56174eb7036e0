"""BERT encoders (`BertModel`, `BertForSequenceClassification`): bidirectional attention within each
sequence, post-LayerNorm blocks, learned absolute positions and token types.

A dedicated encoder forward, not the paged-attention path: an encoder keeps no KV after its one step, so
the step's sequences run packed ([T, hidden], no padding) through every linear layer (the FLOPs), and only
attention sees them padded to the step's longest sequence ([B, heads, L, d], a key-padding mask) through
`scaled_dot_product_attention`. Token types are derived from the ids: 1 after the first [SEP] (the second
segment of a tokenizer's text pair), 0 before, which is what `tokenizer(text_a, text_b)` produces."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.model_executor.layers import batch_invariant
from pagedllm.model_executor.layers.cpu_gemm import packed_linear
from pagedllm.model_executor.layers.fused_linear import QKVParallelLinear
from pagedllm.model_executor.layers.linear import ReplicatedLinear
from pagedllm.model_executor.models.learned_pos import load_renamed

ATTN_CHUNK_SEQS = 32
"""Sequences per attention chunk: each chunk is padded to its own longest sequence only."""


@dataclass
class AttnChunk:
    """Sequences [first token `t0`, `t1`) of the packed step, padded to `max_len` for attention:
    `pad_index` [t1 - t0] each token's row in the chunk's [n * max_len] layout, `gather` [n * max_len] the
    packed row each padded row reads (padding rows read the chunk's first token: finite, masked as keys, their
    query outputs dropped), `key_mask` [n, 1, 1, L]. The last two are None when the lengths are equal."""

    t0: int
    t1: int
    num_seqs: int
    max_len: int
    pad_index: torch.Tensor | None
    gather: torch.Tensor | None
    key_mask: torch.Tensor | None


@dataclass
class EncoderBatch:
    """The step's sequences, packed ([T] tokens); `seq_lens` [B] on the host. Callers sort the sequences
    by length so that each attention chunk of `ATTN_CHUNK_SEQS` pads little."""

    seq_lens: torch.Tensor
    chunks: list[AttnChunk]

    @property
    def num_tokens(self) -> int:
        return self.chunks[-1].t1 if self.chunks else 0

    @staticmethod
    def build(seq_lens: list[int], device: torch.device) -> EncoderBatch:
        lens = torch.tensor(seq_lens, dtype=torch.long)
        chunks = []
        t0 = 0
        for i in range(0, len(seq_lens), ATTN_CHUNK_SEQS):
            cl = lens[i : i + ATTN_CHUNK_SEQS]
            max_len = int(cl.max())
            n, total = len(cl), int(cl.sum())
            if int(cl.min()) == max_len:
                chunks.append(AttnChunk(t0, t0 + total, n, max_len, None, None, None))
            else:
                starts = torch.arange(n, dtype=torch.long) * max_len
                pad_index = torch.repeat_interleave(starts, cl) + _ranges(cl)
                gather = torch.full((n * max_len,), t0, dtype=torch.long)
                gather[pad_index] = torch.arange(t0, t0 + total, dtype=torch.long)
                key_mask = (torch.arange(max_len)[None, :] < cl[:, None])[:, None, None, :]
                chunks.append(
                    AttnChunk(t0, t0 + total, n, max_len, pad_index.to(device), gather.to(device), key_mask.to(device))
                )
            t0 += total
        return EncoderBatch(lens, chunks)


def _ranges(lens: torch.Tensor) -> torch.Tensor:
    """[0..l0-1, 0..l1-1, ...] for the lengths `lens`."""
    total = int(lens.sum())
    offsets = torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)
    return torch.arange(total, dtype=torch.long) - offsets


class BertSelfAttention(nn.Module):
    def __init__(self, config: Any, prefix: str) -> None:
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        self.num_heads, self.head_dim = heads, hidden // heads
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, heads, heads, bias=True, prefix=f"{prefix}.qkv_proj")
        self.out_proj = ReplicatedLinear(hidden, hidden, bias=True, prefix=f"{prefix}.out_proj")
        self.out_norm = nn.LayerNorm(hidden, eps=float(config.layer_norm_eps))
        """Applied by `BertLayer` (after the residual add): a checkpoint's `attention.output.LayerNorm`."""

    def forward(self, x: torch.Tensor, eb: EncoderBatch, gemm_dtype: torch.dtype) -> torch.Tensor:
        """Self-attention of `x` [T, hidden] (packed): the output projection's result, in `gemm_dtype`, without
        the residual (the caller adds it). The projections take their input in `gemm_dtype`; attention itself
        (scores, softmax) runs in `x`'s dtype."""
        qkv = self.qkv_proj(x.to(gemm_dtype))
        if len(eb.chunks) == 1 and eb.chunks[0].key_mask is None:
            out = self._attend(qkv, eb.chunks[0], x.dtype)
        else:
            out = x.new_empty(x.shape)
            for c in eb.chunks:
                o = self._attend(qkv, c, x.dtype)
                if c.pad_index is not None:  # back to packed rows, straight into the output
                    torch.index_select(o, 0, c.pad_index, out=out[c.t0 : c.t1])
                else:
                    out[c.t0 : c.t1] = o
        return self.out_proj(out.to(gemm_dtype))

    def _attend(self, qkv: torch.Tensor, c: AttnChunk, dtype: torch.dtype) -> torch.Tensor:
        """One chunk's attention in `dtype`: [num_seqs * max_len, hidden] (its padded rows included)."""
        h, d = self.num_heads, self.head_dim
        part = qkv[c.t0 : c.t1] if c.gather is None else qkv.index_select(0, c.gather)
        q, k, v = part.to(dtype).view(c.num_seqs, c.max_len, 3, h, d).permute(2, 0, 3, 1, 4).unbind(0)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=c.key_mask)
        return o.transpose(1, 2).reshape(c.num_seqs * c.max_len, h * d)


class BertLayer(nn.Module):
    def __init__(self, config: Any, prefix: str) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        self.attention = BertSelfAttention(config, f"{prefix}.attention")
        self.fc1 = ReplicatedLinear(hidden, inter, bias=True, prefix=f"{prefix}.fc1")
        self.fc2 = ReplicatedLinear(inter, hidden, bias=True, prefix=f"{prefix}.fc2")
        self.norm = nn.LayerNorm(hidden, eps=float(config.layer_norm_eps))
        act = getattr(config, "hidden_act", "gelu")
        if act not in ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu"):
            raise ValueError(f"BERT hidden_act {act!r} is not supported")
        self.approximate = "tanh" if act in ("gelu_new", "gelu_pytorch_tanh") else "none"
        self.relu = act == "relu"

    def forward(self, x: torch.Tensor, eb: EncoderBatch, gemm_dtype: torch.dtype) -> torch.Tensor:
        """`x` [T, hidden] is the residual stream; the linear layers take it cast to `gemm_dtype` (a no-op
        unless mixed precision is on, `pooling/cpu_mixed.py`) and their outputs stay in that dtype up to
        the residual add, which promotes back to the stream's dtype."""
        x = self.attention.out_norm(x + self.attention(x, eb, gemm_dtype))
        xg = x.to(gemm_dtype)
        packed = getattr(self.fc1, "packed_weight", None)
        if packed is not None and not self.relu and not batch_invariant.enabled():  # CPU: GELU in the GEMM
            y = packed_linear(xg, packed, self.fc1.bias, int(self.fc1.packed_out_features), gelu=self.approximate)
        else:
            y = self.fc1(xg)
            y = F.relu(y) if self.relu else F.gelu(y, approximate=self.approximate)
        return self.norm(x + self.fc2(y))


class BertEncoderModel(nn.Module):
    """Embeddings + layers: [T] packed ids -> [T, hidden] last hidden states (HF's `last_hidden_state`)."""

    def __init__(self, config: Any, with_pooler: bool) -> None:
        super().__init__()
        if getattr(config, "position_embedding_type", "absolute") != "absolute":
            raise ValueError("BERT: only position_embedding_type 'absolute' is supported")
        hidden = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, hidden)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, hidden)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, hidden)
        self.emb_norm = nn.LayerNorm(hidden, eps=float(config.layer_norm_eps))
        self.layers = nn.ModuleList(BertLayer(config, f"layers.{i}") for i in range(config.num_hidden_layers))
        self.pooler = ReplicatedLinear(hidden, hidden, bias=True, prefix="pooler") if with_pooler else None
        self.sep_token_id = getattr(config, "sep_token_id", None)
        self.multi_type = config.type_vocab_size > 1
        self.position_offset = 0
        """Added to the 0-based positions: RoBERTa's position ids start after its padding index."""
        self.gemm_dtype: torch.dtype | None = None
        """The linear layers' input dtype when it differs from the residual stream's (`pooling/cpu_mixed.py`)."""

    def token_types(self, input_ids: torch.Tensor, eb: EncoderBatch) -> torch.Tensor:
        if not self.multi_type or self.sep_token_id is None:
            return torch.zeros_like(input_ids)
        is_sep = (input_ids == self.sep_token_id).long()
        seg = torch.cumsum(is_sep, 0)
        # Per sequence: SEPs before this token (inclusive count minus the token itself), from its sequence start.
        starts = torch.cumsum(eb.seq_lens, 0) - eb.seq_lens
        before = seg - is_sep
        base = (seg - is_sep)[starts.to(input_ids.device)]
        per_seq = before - torch.repeat_interleave(base, eb.seq_lens.to(input_ids.device))
        return (per_seq > 0).long()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, eb: EncoderBatch) -> torch.Tensor:
        x = (
            self.word_embeddings(input_ids)
            + self.position_embeddings(positions + self.position_offset if self.position_offset else positions)
            + self.token_type_embeddings(self.token_types(input_ids, eb))
        )
        x = self.emb_norm(x)
        gemm_dtype = self.gemm_dtype or x.dtype
        for layer in self.layers:
            x = layer(x, eb, gemm_dtype)
        return x


_RENAMES = (
    ("embeddings.LayerNorm.", "emb_norm."),
    ("encoder.layer.", "layers."),
    (".attention.output.dense.", ".attention.out_proj."),
    (".attention.output.LayerNorm.", ".attention.out_norm."),
    (".intermediate.dense.", ".fc1."),
    (".output.dense.", ".fc2."),
    (".output.LayerNorm.", ".norm."),
    ("pooler.dense.", "pooler."),
)
_QKV = {".attention.self.query.": "q", ".attention.self.key.": "k", ".attention.self.value.": "v"}


def _rename(name: str, prefix: str) -> tuple[str, Any] | None:
    if name.startswith(prefix):
        name = name[len(prefix) :]
    if name.endswith("position_ids"):
        return None
    for part, shard in _QKV.items():
        if part in name:
            return name.replace(part, ".attention.qkv_proj.").replace("encoder.layer.", "layers."), shard
    if name.startswith("embeddings.") and not name.startswith("embeddings.LayerNorm."):
        return name[len("embeddings.") :], None
    for old, new in _RENAMES:
        name = name.replace(old, new)
    return name, None


class BertModel(nn.Module):
    """An embedder: last hidden states to the pooler (sentence-transformers models: mean / CLS pooling)."""

    is_encoder_only = True
    default_pooling_type = "CLS"

    def __init__(self, hf_config: Any, prefix: str = "") -> None:
        super().__init__()
        self.config = hf_config
        self.model = BertEncoderModel(hf_config, with_pooler=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, eb: EncoderBatch) -> torch.Tensor:
        return self.model(input_ids, positions, eb)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def rename(name: str, t: torch.Tensor) -> tuple[str, torch.Tensor, Any] | None:
            if name.startswith(("pooler.", "bert.pooler.", "cls.")):
                return None  # HF's pooler head: not part of the embedder's output
            r = _rename(name, "bert.")
            return None if r is None else (f"model.{r[0]}", t, r[1])

        return load_renamed(self, weights, rename)


class BertForSequenceClassification(nn.Module):
    """A cross-encoder / classifier: HF's pooler (dense + tanh on [CLS]) then the classifier."""

    is_encoder_only = True
    default_pooling_type = "CLS"

    def __init__(self, hf_config: Any, prefix: str = "") -> None:
        super().__init__()
        self.config = hf_config
        self.model = BertEncoderModel(hf_config, with_pooler=True)
        self.classifier = ReplicatedLinear(hf_config.hidden_size, hf_config.num_labels, bias=True, prefix="classifier")

    @property
    def num_labels(self) -> int:
        return int(self.config.num_labels)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, eb: EncoderBatch) -> torch.Tensor:
        return self.model(input_ids, positions, eb)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """[N, hidden] CLS hidden states -> [N, num_labels] logits."""
        assert self.model.pooler is not None
        return self.classifier(torch.tanh(self.model.pooler(pooled)))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def rename(name: str, t: torch.Tensor) -> tuple[str, torch.Tensor, Any] | None:
            if name.startswith("classifier."):
                return name, t, None
            r = _rename(name, "bert.")
            return None if r is None else (f"model.{r[0]}", t, r[1])

        return load_renamed(self, weights, rename)
