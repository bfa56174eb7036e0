"""Turns a user prompt + SamplingParams into a validated, tokenized EngineCoreRequest."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from pagedllm.config import LoRAConfig, ModelConfig
from pagedllm.inputs import PromptType
from pagedllm.lora.request import LoRARequest
from pagedllm.messages import EngineCoreRequest
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams


class InputProcessor:
    def __init__(
        self,
        model_config: ModelConfig,
        tokenizer: Any | None,
        logits_processors: Sequence[Any] | None = None,
        lora_config: LoRAConfig | None = None,
        *,
        speculative: bool = False,
        structured_outputs_config: Any = None,
        multimodal_config: Any = None,
    ) -> None:
        self.model_config = model_config
        self.multimodal_config = multimodal_config
        self._mm: Any = None
        self.speculative = speculative
        """Speculative decoding is on: structured outputs are rejected (no grammar rollback)."""
        self.structured_outputs_config = structured_outputs_config
        self.lora_config = lora_config
        self._checked_loras: dict[tuple[int, str], bool] = {}
        """Adapters already validated (id, path): one check per adapter, not per prompt."""
        self.logits_processors = list(logits_processors or [])
        """Custom logits processors: each request is checked with their `validate_params`."""
        self.tokenizer = tokenizer
        self.max_model_len = model_config.max_model_len
        self.vocab_size = model_config.vocab_size
        eos = model_config.eos_token_ids
        if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
            self.eos_token_id: int | None = int(tokenizer.eos_token_id)
        else:
            self.eos_token_id = eos[0] if eos else None
        self.extra_eos_ids = [e for e in eos if e != self.eos_token_id]
        """generation_config may list several EOS ids (Llama 3): the rest act as stop token ids."""

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int], str | None]:
        """(prompt text or None, token ids, cache salt)."""
        if isinstance(prompt, str):
            return prompt, self._encode(prompt), None
        if isinstance(prompt, dict):
            salt = prompt.get("cache_salt")
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]  # type: ignore[typeddict-item]
                if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
                    raise ValueError("prompt_token_ids: must be a list of integers")
                return prompt.get("prompt"), list(ids), salt  # type: ignore[return-value]
            if "prompt" in prompt and isinstance(prompt["prompt"], str):
                return prompt["prompt"], self._encode(prompt["prompt"]), salt
        raise ValueError(
            f"prompt: expected a string, a TextPrompt {{'prompt': str}} or a TokensPrompt "
            f"{{'prompt_token_ids': [...]}}, got {type(prompt).__name__}"
        )

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("prompt: text prompts need a tokenizer (skip_tokenizer_init=True): pass token ids")
        return list(self.tokenizer.encode(text))

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        prompt_token_ids: list[int] | None = None,
        prompt_text: str | None = None,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> tuple[EngineCoreRequest, str | None]:
        if isinstance(prompt, dict) and (prompt.get("multi_modal_data") is not None or prompt.get("mm_features")):
            if isinstance(params, PoolingParams) or self.model_config.runner_type == "pooling":
                raise ValueError("multi_modal_data: images are not supported for pooling requests")
            if self.speculative:
                raise ValueError("multi_modal_data: images are not supported together with speculative decoding")
        if isinstance(params, PoolingParams) or self.model_config.runner_type == "pooling":
            from pagedllm.pooling.inputs import process_pooling

            return process_pooling(
                self, request_id, prompt, params, arrival_time, priority, prompt_token_ids, prompt_text, cache_salt
            )
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params: expected SamplingParams, got {type(params).__name__}")
        if lora_request is not None:
            self.validate_lora(lora_request)
        mm_features = None
        if prompt_token_ids is None and isinstance(prompt, dict) and prompt.get("multi_modal_data") is not None:
            prompt_text, prompt_token_ids, mm_features = self.process_multimodal(prompt)
            cache_salt = prompt.get("cache_salt")
        elif prompt_token_ids is None and isinstance(prompt, dict) and prompt.get("mm_features"):
            # Already through `process_multimodal` (the chat server processes images off its event loop).
            prompt_text, prompt_token_ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])  # type: ignore[typeddict-item]
            mm_features, cache_salt = prompt["mm_features"], prompt.get("cache_salt")  # type: ignore[typeddict-item]
        elif prompt_token_ids is None:
            prompt_text, prompt_token_ids, cache_salt = self.tokenize(prompt)
        self.validate_prompt(prompt_token_ids)
        self.validate_sampling(params)
        # As vLLM: the model's other EOS ids stop generation too, unless the request ignores EOS.
        stop_ids = list(params.stop_token_ids or [])
        if not params.ignore_eos:
            stop_ids += [e for e in self.extra_eos_ids if e not in stop_ids]
        all_stop = list(dict.fromkeys(stop_ids + ([self.eos_token_id] if self.eos_token_id is not None else [])))
        sp = params.clone(
            stop_token_ids=stop_ids,
            eos_token_id=self.eos_token_id,
            all_stop_token_ids=all_stop,
        )
        if sp.bad_words:
            sp.update_from_tokenizer(self.tokenizer)
            sp.verify_against_vocab(self.vocab_size, self.model_config.max_logprobs)
        if sp.detokenize and self.tokenizer is None:
            sp = sp.clone(detokenize=False)
        req = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=sp,
            arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
            priority=priority,
            cache_salt=cache_salt,
            lora_id=lora_request.lora_int_id if lora_request is not None else None,
            lora_request=lora_request,
            mm_features=mm_features or None,
        )
        return req, prompt_text

    @property
    def mm_processor(self) -> Any:
        """The model's `MultiModalProcessor`, or None for a text-only model."""
        if self._mm is None:
            from pagedllm.multimodal.config import MultiModalConfig
            from pagedllm.multimodal.processing import MultiModalProcessor, get_mm_spec

            mc = self.model_config
            spec = get_mm_spec(mc.hf_config)
            if spec is None:
                self._mm = False
            else:
                self._mm = MultiModalProcessor(
                    mc.hf_config, mc.model_dir, self.multimodal_config or MultiModalConfig(), spec
                )
        return self._mm or None

    def process_multimodal(self, prompt: Any) -> tuple[str, list[int], list[Any]]:
        """(prompt text, token ids with the image placeholders expanded, the images' features)."""
        mm = self.mm_processor
        if mm is None:
            archs = ", ".join(self.model_config.architectures)
            raise ValueError(f"multi_modal_data: the model ({archs}) is text-only and does not accept images")
        text = prompt.get("prompt")
        if not isinstance(text, str):
            raise ValueError("multi_modal_data: needs a text 'prompt' (the processor expands its image placeholders)")
        kwargs = prompt.get("mm_processor_kwargs")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise ValueError(f"mm_processor_kwargs: expected a dict, got {type(kwargs).__name__}")
        ids, features = mm.process(text, prompt["multi_modal_data"], kwargs)
        return text, ids, features

    def validate_lora(self, lora_request: LoRARequest) -> None:
        """ValueError for an adapter the engine cannot serve (LoRA off, missing files, rank over
        max_lora_rank, shapes of another base model); reads its config and tensor header only."""
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request: expected a LoRARequest, got {type(lora_request).__name__}")
        if self.lora_config is None:
            raise ValueError("lora_request: LoRA is not enabled (start the engine with enable_lora=True)")
        key = (lora_request.lora_int_id, lora_request.lora_path)
        if key not in self._checked_loras:
            from pagedllm.lora.peft import check_adapter

            check_adapter(lora_request.lora_path, self.model_config.hf_config, self.lora_config.max_lora_rank)
            self._checked_loras[key] = True

    def validate_sampling(self, params: SamplingParams) -> None:
        """Checks that need the model or the engine: vocabulary ranges, max_logprobs, custom processors."""
        params.verify_against_vocab(self.vocab_size, self.model_config.max_logprobs)
        if params.bad_words and self.tokenizer is None:
            raise ValueError("bad_words: needs a tokenizer (skip_tokenizer_init=True)")
        for proc in self.logits_processors:
            proc.validate_params(params)
        if params.structured_outputs is not None:
            self.validate_structured_outputs(params)

    def validate_structured_outputs(self, params: SamplingParams) -> None:
        """The constraint parses (JSON schema, regex, EBNF grammar): a ValueError naming the field here, before
        the engine, where it is cheap; the engine core compiles it for the tokenizer off its step loop."""
        if self.speculative:
            raise ValueError("structured_outputs: not supported together with speculative decoding")
        if self.tokenizer is None:
            raise ValueError("structured_outputs: needs a tokenizer (skip_tokenizer_init=True)")
        from pagedllm.structured_output.backend import validate

        assert params.structured_outputs is not None
        validate(params.structured_outputs, self.structured_outputs_config)

    def validate_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("prompt: the prompt is empty (no tokens)")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt: the prompt has {len(ids)} tokens, but max_model_len is {self.max_model_len} "
                "(it must leave room for at least one output token)"
            )
        lo, hi = min(ids), max(ids)
        if lo < 0 or hi >= self.vocab_size:
            raise ValueError(
                f"prompt: token id {hi if hi >= self.vocab_size else lo} is out of the vocabulary "
                f"(size {self.vocab_size})"
            )
