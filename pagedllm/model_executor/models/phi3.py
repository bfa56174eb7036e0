"""Phi-3: the Llama architecture with checkpoints that already fuse q/k/v (`qkv_proj`) and gate/up
(`gate_up_proj`); those load through the fused layers' split-on-load path (`shard_id=None`). `longrope`
scaling (Phi-3 128k variants) is not implemented: such configs fail at start-up naming the rope type."""

from __future__ import annotations

from pagedllm.model_executor.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    pass
