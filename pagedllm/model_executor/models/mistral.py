"""Mistral: the Llama architecture with an optional sliding window (taken from `config.sliding_window`)."""

from __future__ import annotations

from pagedllm.model_executor.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass
