"""Building models and loading their weights (safetensors, .bin, GGUF or dummy)."""

from pagedllm.model_executor.model_loader.loader import build_model, get_architectures, load_model

__all__ = ["build_model", "get_architectures", "load_model"]
