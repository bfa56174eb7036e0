"""Maps HF `architectures` names to model classes (imported lazily)."""

from __future__ import annotations

import importlib

from torch import nn

_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("mistral", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Qwen2MoeForCausalLM": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "OlmoeForCausalLM": ("olmoe", "OlmoeForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "GPT2LMHeadModel": ("gpt2", "GPT2LMHeadModel"),
    "OPTForCausalLM": ("opt", "OPTForCausalLM"),
    "Gemma2ForCausalLM": ("gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "GraniteForCausalLM": ("granite", "GraniteForCausalLM"),
    # Vision-language models (pagedllm/multimodal feeds their images).
    "LlavaForConditionalGeneration": ("llava", "LlavaForConditionalGeneration"),
    "Gemma3ForConditionalGeneration": ("gemma3_mm", "Gemma3ForConditionalGeneration"),
    "Qwen2VLForConditionalGeneration": ("qwen2_vl", "Qwen2VLForConditionalGeneration"),
    "Qwen2_5_VLForConditionalGeneration": ("qwen2_vl", "Qwen2_5_VLForConditionalGeneration"),
    # Encoder-only pooling models (pagedllm/pooling runs them).
    "BertModel": ("bert", "BertModel"),
    "BertForSequenceClassification": ("bert", "BertForSequenceClassification"),
    "XLMRobertaModel": ("roberta", "XLMRobertaModel"),
    "XLMRobertaForSequenceClassification": ("roberta", "XLMRobertaForSequenceClassification"),
    "RobertaModel": ("roberta", "RobertaModel"),
    "RobertaForSequenceClassification": ("roberta", "RobertaForSequenceClassification"),
}


def get_supported_archs() -> list[str]:
    return list(_MODELS)


def get_model_class(architectures: list[str] | None) -> type[nn.Module]:
    """The class of the first supported entry of `architectures`; ValueError if none is supported."""
    for arch in architectures or []:
        if arch in _MODELS:
            module_name, cls_name = _MODELS[arch]
            module = importlib.import_module(f"pagedllm.model_executor.models.{module_name}")
            return getattr(module, cls_name)
    raise ValueError(
        f"Model architectures {list(architectures or [])} are not supported. "
        f"Supported architectures: {', '.join(_MODELS)}"
    )
