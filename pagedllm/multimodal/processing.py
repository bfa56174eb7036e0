"""Prompt + images -> token ids with each image's placeholder expanded, and one `MultiModalFeature` per
image, through the model's own HF processor (`AutoProcessor`: image preprocessing and prompt expansion are
reused, not rewritten). The model class says, through its `mm_spec`, which token is the image placeholder
and how the processor's batched tensors split into per-image items."""

from __future__ import annotations

import hashlib
import inspect
import json
import os
from typing import Any, Protocol

import torch

from pagedllm.multimodal.config import MultiModalConfig
from pagedllm.multimodal.inputs import MultiModalFeature, TensorData
from pagedllm.multimodal.media import to_image


class MultiModalSpec(Protocol):
    """What a vision-language model class tells the front end (its `mm_spec` attribute)."""

    @staticmethod
    def image_token_id(hf_config: Any) -> int: ...

    @staticmethod
    def prompt_placeholder(processor: Any) -> str:
        """The text a chat message's image part becomes before the processor expands it."""
        ...

    @staticmethod
    def split_items(processed: dict[str, torch.Tensor], num_images: int) -> list[dict[str, torch.Tensor]]:
        """The processor's batched image tensors as one dict per image."""
        ...

    @staticmethod
    def num_tokens(hf_config: Any, item: dict[str, torch.Tensor]) -> int:
        """Placeholder tokens (= encoder output rows) of one image."""
        ...


def get_mm_spec(hf_config: Any) -> MultiModalSpec | None:
    from pagedllm.model_executor.model_loader.loader import get_architectures
    from pagedllm.model_executor.models.registry import get_model_class

    return getattr(get_model_class(get_architectures(hf_config)), "mm_spec", None)


def _processor_class_name(model_dir: str) -> str | None:
    for name in ("processor_config.json", "preprocessor_config.json"):
        path = os.path.join(model_dir, name)
        if os.path.isfile(path):
            with open(path) as f:
                cls = json.load(f).get("processor_class")
            if cls:
                return str(cls)
    return None


def load_hf_processor(model_dir: str) -> Any:
    """The model's HF processor (`AutoProcessor`). Processors that also handle video (Qwen2-VL's) cannot be
    built where the video processor's backend (torchvision) is missing: then the same HF processor class is
    built with its image processor and tokenizer only (images need nothing else)."""
    import transformers

    try:
        return transformers.AutoProcessor.from_pretrained(model_dir)
    except (ImportError, ValueError, AttributeError, TypeError) as e:
        name = _processor_class_name(model_dir)
        cls = getattr(transformers, name, None) if name else None
        if cls is None or "video_processor" not in inspect.signature(cls.__init__).parameters:
            raise
        first_error = e

    class ImageOnlyProcessor(cls):  # type: ignore[misc, valid-type]
        def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None, **kw: Any):
            super().__init__(image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template, **kw)

    ImageOnlyProcessor.__name__ = cls.__name__
    try:
        return ImageOnlyProcessor.from_pretrained(model_dir)
    except Exception:
        raise first_error from None


def hash_item(item: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k in sorted(item):
        t = item[k].detach().cpu().contiguous()
        h.update(f"{k}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


class MultiModalProcessor:
    def __init__(self, hf_config: Any, model_dir: str, config: MultiModalConfig, spec: MultiModalSpec) -> None:
        self.hf_config = hf_config
        self.model_dir = model_dir
        self.config = config
        self.spec = spec
        self.image_token_id = spec.image_token_id(hf_config)
        self._processor: Any = None

    @property
    def processor(self) -> Any:
        if self._processor is None:
            self._processor = load_hf_processor(self.model_dir)
        return self._processor

    def prompt_placeholder(self) -> str:
        return self.spec.prompt_placeholder(self.processor)

    def process(
        self, prompt: str, mm_data: Any, mm_processor_kwargs: dict[str, Any] | None = None
    ) -> tuple[list[int], list[MultiModalFeature]]:
        """Token ids of `prompt` with its images' placeholders expanded, and the images' features."""
        if not isinstance(mm_data, dict):
            raise ValueError(f"multi_modal_data: expected a dict like {{'image': ...}}, got {type(mm_data).__name__}")
        unknown = sorted(set(mm_data) - {"image"})
        if unknown:
            raise ValueError(f"multi_modal_data: unsupported modality {unknown[0]!r} (only 'image')")
        raw = mm_data.get("image")
        items = [] if raw is None else list(raw) if isinstance(raw, (list, tuple)) else [raw]
        limit = self.config.limit("image")
        if len(items) > limit:
            raise ValueError(
                f"multi_modal_data: {len(items)} images given, but limit_mm_per_prompt allows at most {limit} "
                "image(s) per prompt"
            )
        images = [to_image(it, f"multi_modal_data.image[{i}]") for i, it in enumerate(items)]
        kwargs = {**self.config.mm_processor_kwargs, **(mm_processor_kwargs or {})}
        try:
            out = self.processor(text=[prompt], images=images or None, return_tensors="pt", **kwargs)
        except (ValueError, TypeError, KeyError, IndexError) as e:
            raise ValueError(f"multi_modal_data: the model's processor rejected the input ({e})") from None
        ids = [int(t) for t in out["input_ids"][0].tolist()]
        data = {k: v for k, v in out.items() if k not in ("input_ids", "attention_mask") and torch.is_tensor(v)}
        per_image = self.spec.split_items(data, len(images)) if images else []
        positions = [i for i, t in enumerate(ids) if t == self.image_token_id]
        lengths = [self.spec.num_tokens(self.hf_config, it) for it in per_image]
        if len(positions) != sum(lengths):
            raise ValueError(
                f"multi_modal_data: the prompt has {len(positions)} image placeholder tokens after expansion but "
                f"{len(images)} image(s) need {sum(lengths)} (one placeholder per image in the prompt)"
            )
        cap = self.config.max_item_tokens
        if cap is not None and any(n > cap for n in lengths):
            raise ValueError(
                f"multi_modal_data: an image takes {max(lengths)} tokens, more than max_num_batched_tokens ({cap}); "
                "with disable_chunked_mm_input (always on for this model) an image must fit one step's token budget"
            )
        features: list[MultiModalFeature] = []
        start = 0
        for item, n in zip(per_image, lengths):
            group = positions[start : start + n]
            if group[-1] - group[0] != n - 1:
                raise ValueError("multi_modal_data: an image's placeholder tokens are not contiguous in the prompt")
            tensors = {k: TensorData.from_tensor(v) for k, v in item.items()}
            features.append(MultiModalFeature("image", hash_item(item), group[0], n, tensors))
            start += n
        return ids, features
