"""Phi-3: the Llama architecture with checkpoints that already fuse q/k/v (`qkv_proj`) and gate/up
(`gate_up_proj`); those load through the fused layers' split-on-load path (`shard_id=None`). The 128k
variants' `longrope` scaling is in `layers/rotary_embedding.py` (factors chosen from max_model_len, as vLLM)."""

from __future__ import annotations

from pagedllm.model_executor.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    pass
