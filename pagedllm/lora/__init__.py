"""Multi-LoRA serving: PEFT adapters applied per token in mixed batches (see docs/ARCHITECTURE.md)."""

from pagedllm.lora.request import LoRARequest

__all__ = ["LoRARequest"]
