"""Model definitions and the architecture registry."""

from pagedllm.model_executor.models.registry import get_model_class, get_supported_archs

__all__ = ["get_model_class", "get_supported_archs"]
