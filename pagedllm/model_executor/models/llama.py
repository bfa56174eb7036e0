"""Llama-family decoder (also the base of the Mistral, Qwen2 and Qwen3 definitions).

Input is the flattened token batch (no batch dim): `forward(input_ids [T], positions [T]) -> [T, hidden]`.
Parameter names follow the HF checkpoint, except that q/k/v and gate/up are fused into `qkv_proj` and
`gate_up_proj`; `load_weights` maps the HF names onto them. The attention block (`LlamaAttention`) is in
`models/llama_attention.py`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from pagedllm.distributed.parallel_state import get_pipeline_model_parallel_rank, get_pipeline_model_parallel_world_size
from pagedllm.distributed.pipeline import Intermediate, PPMissingLayer, get_pp_indices, is_first_stage, is_last_stage
from pagedllm.model_executor.layers import triton_gemv
from pagedllm.model_executor.layers.activation import SiluAndMul
from pagedllm.model_executor.layers.fused_linear import MergedColumnParallelLinear
from pagedllm.model_executor.layers.layernorm import RMSNorm
from pagedllm.model_executor.layers.linear import RowParallelLinear, plain_row_gemv_weight
from pagedllm.model_executor.layers.quantization import act_twin
from pagedllm.model_executor.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.model_executor.model_loader.weight_utils import default_weight_loader
from pagedllm.model_executor.models.llama_attention import LlamaAttention

if TYPE_CHECKING:
    from pagedllm.distributed.fused_allreduce_norm import AllReduceNorm, PartialSender

logger = logging.getLogger(__name__)

# (fused param name, HF name, shard id)
STACKED_PARAMS_MAPPING: list[tuple[str, str, str | int]] = [
    (".qkv_proj", ".q_proj", "q"),
    (".qkv_proj", ".k_proj", "k"),
    (".qkv_proj", ".v_proj", "v"),
    (".gate_up_proj", ".gate_proj", 0),
    (".gate_up_proj", ".up_proj", 1),
]
_SHARDS_PER_FUSED = {".qkv_proj": 3, ".gate_up_proj": 2}
# Buffers some checkpoints carry that we recompute.
_SKIP_SUBSTRINGS = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, prefix: str = "") -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, bias=bias, prefix=f"{prefix}.gate_up_proj"
        )
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, prefix=f"{prefix}.down_proj")
        self.act_fn = SiluAndMul()

    chunk_tokens = 0
    """Set by `chunk_mlps`: a batch of more tokens goes through the block in chunks of this many, which bounds
    the [tokens, 2 x intermediate] gate/up output, a long prefill step's largest activation (and so the memory
    the start-up profile takes from the KV cache). 0: never (every row is computed the same way either way)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c, n = self.chunk_tokens, x.shape[0]
        if n == 1 and (gate_up_weight := plain_row_gemv_weight(self.gate_up_proj, x)) is not None:
            # Batch-1 decode on CUDA: gate/up GEMV and SiLU-mul in one launch (same rounding, one kernel less)
            return self.down_proj(triton_gemv.row_gemv(x, gate_up_weight, glu=True))
        if c <= 0 or n <= c:
            return self.down_proj(self.act_fn(self.gate_up_proj(x)))
        out: torch.Tensor | None = None
        for s in range(0, n, c):
            y = self.down_proj(self.act_fn(self.gate_up_proj(act_twin.rows(x, s, s + c))))
            if out is None:  # (the output's width and dtype come from the layer: sized at the first chunk)
                out = y.new_empty((n, *y.shape[1:]))
            out[s : s + c] = y
        assert out is not None
        return out


def chunk_mlps(model: nn.Module, tokens: int) -> int:
    """Every dense `LlamaMLP` of `model` runs batches above `tokens` in chunks (see `LlamaMLP.chunk_tokens`);
    not where per-token state spans the whole batch inside the block (LoRA's hooks). Returns how many."""
    mlps = [m for m in model.modules() if type(m) is LlamaMLP]
    for m in mlps:
        m.chunk_tokens = tokens
    return len(mlps)


class LlamaDecoderLayer(nn.Module):
    attn_cls: type[LlamaAttention] = LlamaAttention

    @staticmethod
    def attn_kwargs(config: Any) -> dict[str, Any]:
        """Per-architecture LlamaAttention options (overridden by Qwen2 / Qwen3)."""
        bias = bool(getattr(config, "attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias}

    def __init__(self, config: Any, layer_idx: int, prefix: str = "") -> None:
        super().__init__()
        self.self_attn = self.attn_cls(config, layer_idx, prefix=f"{prefix}.self_attn", **self.attn_kwargs(config))
        self.mlp = self.make_mlp(config, layer_idx, prefix=f"{prefix}.mlp")
        eps = float(getattr(config, "rms_norm_eps", 1e-6))
        self.input_layernorm = RMSNorm(config.hidden_size, eps=eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=eps)

    def make_mlp(self, config: Any, layer_idx: int, prefix: str) -> nn.Module:
        """The layer's feed-forward block (overridden by the mixture-of-experts models)."""
        return LlamaMLP(
            config.hidden_size,
            config.intermediate_size,
            bias=bool(getattr(config, "mlp_bias", False)),
            prefix=prefix,
        )

    def twin_pairs(self) -> list[tuple[nn.Module, nn.Module]]:
        """(producer, linear) pairs where the producer's output goes straight into the linear: the norms and the
        SiLU-mul, which may write a twin of their output for it (quantization/act_twin.py), and the attention,
        which may write o_proj's q8 twin (GGUF)."""
        pairs: list[tuple[nn.Module, nn.Module]] = [(self.input_layernorm, self.self_attn.qkv_proj)]
        if self.attn_cls is LlamaAttention:
            pairs.append((self.self_attn.attn, self.self_attn.o_proj))
        if type(self.mlp) is LlamaMLP:
            pairs.append((self.post_attention_layernorm, self.mlp.gate_up_proj))
            pairs.append((self.mlp.act_fn, self.mlp.down_proj))
        return pairs

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    decoder_layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer
    decode_stack: Any = None
    """A `quantization.gguf_decode_stack.DecodeStack`, set by the GGUF loader where it applies."""

    def __init__(self, config: Any, prefix: str = "model") -> None:
        super().__init__()
        self.config = config
        self.vocab_size = config.vocab_size
        # Pipeline parallelism: this stage's layers only; the embedding on the first stage (and on the last
        # where the LM head is tied to it), the final norm on the last (pagedllm/distributed/pipeline.py).
        n = config.num_hidden_layers
        self.start_layer, self.end_layer = get_pp_indices(
            n, get_pipeline_model_parallel_rank(), get_pipeline_model_parallel_world_size()
        )
        self.is_first_stage, self.is_last_stage = is_first_stage(), is_last_stage()
        self.act_dtype = torch.get_default_dtype()
        """The activations' dtype (the loader builds the model under the model dtype as the default): a later
        pipeline stage's warm-up forward starts from zeros of it."""
        tied = bool(getattr(config, "tie_word_embeddings", False))
        if self.is_first_stage or (tied and self.is_last_stage):
            self.embed_tokens = VocabParallelEmbedding(
                config.vocab_size, config.hidden_size, prefix=f"{prefix}.embed_tokens"
            )
        else:
            self.embed_tokens = cast(VocabParallelEmbedding, PPMissingLayer())
        self.layers = nn.ModuleList(
            self.decoder_layer_cls(config, i, prefix=f"{prefix}.layers.{i}")
            if self.start_layer <= i < self.end_layer
            else PPMissingLayer()
            for i in range(n)
        )
        eps = float(getattr(config, "rms_norm_eps", 1e-6))
        self.norm = RMSNorm(config.hidden_size, eps=eps) if self.is_last_stage else PPMissingLayer()
        self.stage_layers: list[nn.Module] = list(self.layers)[self.start_layer : self.end_layer]
        """This stage's layers, as a plain list (slicing the ModuleList would build a new one every forward)."""

    def supports_deferred_tp_reductions(self) -> bool:
        """Whether every layer of this stage is a plain dense Llama layer whose o_proj and down_proj outputs
        feed the next residual add + RMSNorm directly (no bias added after the sum, no other layer forward)."""
        layers: list[Any] = self.stage_layers
        return bool(layers) and all(
            type(layer).forward is LlamaDecoderLayer.forward
            and type(layer.mlp) is LlamaMLP
            and layer.self_attn.o_proj.bias is None
            and layer.mlp.down_proj.bias is None
            for layer in layers
        )

    def defer_tp_reductions(self, reduce: AllReduceNorm, sender: PartialSender | None = None) -> None:
        """Tensor parallelism: o_proj and down_proj leave their partial sums un-reduced, and the RMSNorm that
        follows each (the next layer's input norm, or the final norm) all-reduces them with its residual add
        (`distributed/fused_allreduce_norm.py`). A layer's output is then a partial sum; its residual is whole.
        With `sender`, o_proj and down_proj may send their partial sums to the peers as they compute them."""
        layers: list[Any] = self.stage_layers
        for layer in layers:
            layer.self_attn.o_proj.reduce_results = False
            layer.mlp.down_proj.reduce_results = False
            layer.self_attn.o_proj.partial_sender = sender
            layer.mlp.down_proj.partial_sender = sender
            layer.input_layernorm.tp_reduce = reduce  # (only given a residual: never the embedding's output)
            layer.post_attention_layernorm.tp_reduce = reduce
        if self.is_last_stage:
            self.norm.tp_reduce = reduce

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate: Intermediate | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | Intermediate:
        """[T, hidden] hidden states; on a pipeline stage before the last, (hidden states, residual).
        `intermediate` is the previous stage's output (a later stage without it, e.g. a warm-up forward,
        starts from zeros). `inputs_embeds` (multimodal: image rows merged in) replaces the embedding lookup."""
        residual: torch.Tensor | None = None
        if intermediate is not None:
            hidden_states, residual = intermediate
        elif inputs_embeds is not None:
            hidden_states = inputs_embeds
        elif self.is_first_stage:
            hidden_states = self.embed_tokens(input_ids)
        else:
            hidden_states = torch.zeros(
                input_ids.shape[0], self.config.hidden_size, dtype=self.act_dtype, device=input_ids.device
            )
            residual = torch.zeros_like(hidden_states)
        stack = self.decode_stack
        if stack is not None and residual is None and (out := stack.run(positions, hidden_states)) is not None:
            hidden_states, residual = out  # every layer in one C call (CPU decode, packed GGUF weights)
        else:
            for layer in self.stage_layers:
                hidden_states, residual = layer(positions, hidden_states, residual)
        if not self.is_last_stage:
            assert residual is not None
            return hidden_states, residual
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    """The causal LM the model runner drives (see the module docstring for the interface)."""

    model_cls: type[LlamaModel] = LlamaModel

    def __init__(self, hf_config: Any, prefix: str = "") -> None:
        super().__init__()
        self.config = hf_config
        model_prefix = f"{prefix}.model" if prefix else "model"
        self.model = self.model_cls(hf_config, prefix=model_prefix)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.lm_head = cast(ParallelLMHead, PPMissingLayer())
        if getattr(self.model, "is_last_stage", True):
            self.lm_head = ParallelLMHead(
                hf_config.vocab_size, hf_config.hidden_size, prefix=f"{prefix}.lm_head" if prefix else "lm_head"
            )
            if self.tie_word_embeddings:
                self.lm_head.tie_weights(self.model.embed_tokens)

    supports_pp = True
    """Pipeline stages: `forward` takes the previous stage's (hidden states, residual)."""

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate: Intermediate | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if intermediate is None and inputs_embeds is None:  # (subclasses' models, e.g. Gemma 3's, take two)
            return self.model(input_ids, positions)  # type: ignore[return-value]
        return self.model(input_ids, positions, intermediate, inputs_embeds)  # type: ignore[return-value]

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Loads HF-named tensors; returns the names of the parameters fully loaded."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        fused_shards: dict[str, set[str | int]] = {}
        for name, tensor in weights:
            if any(s in name for s in _SKIP_SUBSTRINGS):
                continue
            if self.tie_word_embeddings and name.startswith("lm_head."):
                continue  # tied to model.embed_tokens (some checkpoints still store a copy)
            for fused, hf_name, shard_id in STACKED_PARAMS_MAPPING:
                if hf_name not in name:
                    continue
                pname = name.replace(hf_name, fused)
                if pname not in params:
                    continue
                param = params[pname]
                param.weight_loader(param, tensor, shard_id)  # type: ignore[attr-defined]
                shards = fused_shards.setdefault(pname, set())
                shards.add(shard_id)
                if len(shards) == _SHARDS_PER_FUSED[fused]:
                    loaded.add(pname)
                break
            else:
                if name not in params:
                    if get_pipeline_model_parallel_world_size() == 1:  # else: another stage's weight
                        logger.warning("load_weights: ignoring checkpoint tensor %s (no such parameter)", name)
                    continue
                param = params[name]
                loader = getattr(param, "weight_loader", default_weight_loader)
                loader(param, tensor)
                loaded.add(name)
        return loaded
