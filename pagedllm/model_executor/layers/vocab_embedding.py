"""Vocabulary-parallel embedding and LM head.

The vocabulary is padded to a multiple of `padding_size` and split in contiguous row ranges across
ranks. Rows past the real vocabulary are zero and their logits are cut off by `compute_logits`.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm import envs
from pagedllm.distributed.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from pagedllm.model_executor.layers import batch_invariant, batch_invariant_gpu, triton_gemv
from pagedllm.model_executor.layers.cpu_gemm import packed_linear
from pagedllm.model_executor.layers.linear import set_weight_attrs

DEFAULT_VOCAB_PADDING_SIZE = 64


def pad_vocab_size(vocab_size: int, pad_to: int = DEFAULT_VOCAB_PADDING_SIZE) -> int:
    return ((vocab_size + pad_to - 1) // pad_to) * pad_to


def _fp32_logits_ok(h: torch.Tensor) -> bool:
    """Float32 logits from a bf16/fp16 GEMM: CUDA only. PAGEDLLM_FP32_LOGITS=0 keeps 16-bit logits."""
    return (
        h.is_cuda
        and h.dtype in (torch.bfloat16, torch.float16)
        and h.dim() == 2
        and envs.PAGEDLLM_FP32_LOGITS
        and _mm_out_dtype_supported(h.device, h.dtype)
    )


@functools.cache
def _mm_out_dtype_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this PyTorch has `torch.mm(..., out_dtype=torch.float32)` for `dtype` on `device`: probed once."""
    try:
        a = torch.ones(2, 8, dtype=dtype, device=device)
        return torch.mm(a, a.t(), out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError):
        return False


class VocabParallelEmbedding(nn.Module):
    """Rank r holds rows [r*n_per, (r+1)*n_per) of the padded table; other ids contribute zeros."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        params_dtype: torch.dtype | None = None,
        padding_size: int = DEFAULT_VOCAB_PADDING_SIZE,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.prefix = prefix
        self.num_embeddings_padded = pad_vocab_size(num_embeddings, padding_size * self.tp_size)
        self.num_embeddings_per_partition = self.num_embeddings_padded // self.tp_size
        self.vocab_start_index = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end_index = self.vocab_start_index + self.num_embeddings_per_partition
        dtype = params_dtype or torch.get_default_dtype()
        self.weight = nn.Parameter(
            torch.empty(self.num_embeddings_per_partition, embedding_dim, dtype=dtype), requires_grad=False
        )
        set_weight_attrs(self.weight, {"output_dim": 0, "weight_loader": self.weight_loader})

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        if loaded_weight.shape[0] != self.num_embeddings or loaded_weight.shape[1:] != param.shape[1:]:
            raise ValueError(
                f"{self.prefix}: checkpoint shape {tuple(loaded_weight.shape)} does not match "
                f"vocab {self.num_embeddings} x {self.embedding_dim}"
            )
        start = min(self.vocab_start_index, self.num_embeddings)
        end = min(self.vocab_end_index, self.num_embeddings)
        param.data[: end - start].copy_(loaded_weight[start:end])
        param.data[end - start :].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        in_range = (input_ids >= self.vocab_start_index) & (input_ids < self.vocab_end_index)
        local = torch.where(in_range, input_ids - self.vocab_start_index, 0)
        out = F.embedding(local, self.weight) * in_range.unsqueeze(-1).to(self.weight.dtype)
        return tensor_model_parallel_all_reduce(out)

    def extra_repr(self) -> str:
        return (
            f"num_embeddings={self.num_embeddings_per_partition}/{self.num_embeddings}, "
            f"embedding_dim={self.embedding_dim}, tp_size={self.tp_size}"
        )


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection to the vocabulary, sharded like `VocabParallelEmbedding`.

    Use `tie_weights(embedding)` to share the input embedding's weight (tie_word_embeddings).
    """

    bias: torch.Tensor | None
    packed_out_features: int

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        bias: bool = False,
        params_dtype: torch.dtype | None = None,
        padding_size: int = DEFAULT_VOCAB_PADDING_SIZE,
        prefix: str = "",
    ) -> None:
        super().__init__(num_embeddings, embedding_dim, params_dtype, padding_size, prefix)
        if bias:
            self.bias = nn.Parameter(
                torch.empty(self.num_embeddings_per_partition, dtype=self.weight.dtype), requires_grad=False
            )
            set_weight_attrs(self.bias, {"output_dim": 0, "weight_loader": self._bias_loader})
        else:
            self.register_parameter("bias", None)

    def _bias_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        start = min(self.vocab_start_index, self.num_embeddings)
        end = min(self.vocab_end_index, self.num_embeddings)
        param.data[: end - start].copy_(loaded_weight[start:end])
        param.data[end - start :].zero_()

    def tie_weights(self, embed_tokens: VocabParallelEmbedding) -> ParallelLMHead:
        self.weight = embed_tokens.weight
        return self

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] (padding columns removed, gathered across ranks)."""
        packed = getattr(self, "packed_weight", None)  # CPU bf16, see model_loader/cpu_packing.py
        gguf_parts = getattr(self, "gguf_weight", None)  # packed GGUF blocks, see model_loader/gguf_packed.py
        if gguf_parts is not None:
            from pagedllm.model_executor.layers.quantization.gguf import gguf_matmul

            logits = gguf_matmul(hidden_states, gguf_parts, self.bias, out_dtype=torch.float32)
        elif packed is not None:
            logits = packed_linear(hidden_states, packed, self.bias, self.packed_out_features)
        elif hidden_states.is_cuda and batch_invariant.enabled():  # one kernel shape for every batch
            logits = batch_invariant_gpu.linear(hidden_states, self.weight, self.bias, out_dtype=torch.float32)
        elif triton_gemv.row_gemv_enabled(hidden_states, self.weight):
            # One decode row: the row GEMV (float32 sums where `_fp32_logits_ok`, as the GEMM below writes).
            # Also what triton_utils.one_row_step relies on: every kernel of a one-row 16-bit decode step is ours.
            fp32 = _fp32_logits_ok(hidden_states)
            logits = triton_gemv.row_gemv(
                hidden_states, self.weight, self.bias, out_dtype=torch.float32 if fp32 else None
            )
        elif self.bias is None and _fp32_logits_ok(hidden_states):
            # 16-bit activations on the GPU: the GEMM writes its float32 accumulators instead of rounding
            # them to bf16 (whose ulp is 0.125 for logits in [16, 32), making near-equal logits tie): same
            # GEMM, and the sampler wanted float32 anyway.
            logits = torch.mm(hidden_states, self.weight.t(), out_dtype=torch.float32)
        else:
            logits = F.linear(hidden_states, self.weight, self.bias)
        if self.tp_size > 1:
            logits = tensor_model_parallel_all_gather(logits, dim=-1)
        return logits[..., : self.num_embeddings]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is not called directly; use compute_logits")
