"""Shared plumbing of the OpenAI handlers: model-name checks, sampling parameters, prompt length checks and the
logprobs of responses (errors in `errors.py`, SSE and stream merging in `streaming.py`)."""

from __future__ import annotations

import functools
from typing import Any

from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.entrypoints.openai.errors import OpenAIServingError, engine_dead_error
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    CompletionLogProbs,
    TopLogprob,
    UsageInfo,
    _SamplingRequest,
)
from pagedllm.logprobs import Logprob, PromptLogprobs
from pagedllm.outputs import CompletionOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams


def sampling_supports(field: str) -> bool:
    return field in SamplingParams.__struct_fields__


DEFAULT_MAX_N = 16
MAX_STOP_STRINGS = 128
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS_ENTRIES = 1024
LOGIT_BIAS_RANGE = 100.0


class OpenAIServing:
    max_n: int = DEFAULT_MAX_N
    """Largest `n` (and `best_of`) accepted; the server's `--max-n`."""

    def check_limits(self, req: _SamplingRequest) -> None:
        """Limits on request sizes that would otherwise cost engine (or detokenizer) time per token: 400s
        before anything is queued."""
        stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise OpenAIServingError(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}", 400, "stop")
        longest = max((len(x) for x in stops), default=0)
        if longest > MAX_STOP_STRING_CHARS:
            raise OpenAIServingError(
                f"stop: each stop string has at most {MAX_STOP_STRING_CHARS} characters, got {longest}", 400, "stop"
            )
        if req.stop_token_ids is not None and len(req.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise OpenAIServingError(
                f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids, got {len(req.stop_token_ids)}",
                400,
                "stop_token_ids",
            )
        if req.logit_bias:
            if len(req.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
                raise OpenAIServingError(
                    f"logit_bias: at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(req.logit_bias)}",
                    400,
                    "logit_bias",
                )
            vocab = self.engine.model_config.vocab_size
            for key, bias in req.logit_bias.items():
                try:
                    tid = int(key)
                except ValueError:
                    raise OpenAIServingError(
                        f"logit_bias: keys must be token ids (integers as strings), got {key[:32]!r}", 400, "logit_bias"
                    ) from None
                if not 0 <= tid < vocab:
                    raise OpenAIServingError(
                        f"logit_bias: token id {key[:32]} is out of the vocabulary (size {vocab})", 400, "logit_bias"
                    )
                if not -LOGIT_BIAS_RANGE <= bias <= LOGIT_BIAS_RANGE:
                    raise OpenAIServingError(
                        f"logit_bias: values must be in [-100, 100], got {bias} for token {tid}", 400, "logit_bias"
                    )

    def __init__(self, engine: AsyncLLM, served_model_names: list[str], chat_template: str | None = None) -> None:
        self.engine = engine
        self.served_model_names = served_model_names
        self.chat_template = chat_template
        self.max_model_len = engine.model_config.max_model_len
        self.default_sampling = engine.get_default_sampling_params()
        self.models: Any = None
        """`serving_models.OpenAIServingModels` (LoRA adapters as model names), set by the app."""

    def lora_for(self, model: str | None) -> Any:
        """The LoRARequest a request's `model` names (None: the base model)."""
        return self.models.lora_for(model) if self.models is not None else None

    @functools.cached_property
    def max_chars_per_token(self) -> int:
        """The longest vocabulary entry in characters: no token stands for more text than this."""
        vocab = self.engine.get_tokenizer().get_vocab()
        return max((len(t) for t in vocab), default=1)

    def precheck_text_len(self, text: str, what: str = "prompt") -> None:
        """Reject a text that cannot fit the context without tokenizing it: a megabyte prompt would cost
        a second of CPU (on a 2-core machine, taken from the model) only to be refused. The bound is
        twice the length the longest token could cover, so normalizers cannot make it wrong."""
        limit = 2 * self.max_model_len * self.max_chars_per_token
        if len(text) > limit:
            raise OpenAIServingError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your {what} has "
                f"{len(text)} characters, more than any text of {self.max_model_len} tokens can have (at most "
                f"{self.max_chars_per_token} characters per token). Please reduce the length of the input.",
                400,
                what,
            )

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def check_model(self, model: str | None) -> str:
        """The name to report; 404 for a model this server does not serve."""
        if self.engine.errored:
            raise engine_dead_error(self.engine.dead_error)
        if model is None or model == "":
            return self.model_name
        if model not in self.served_model_names and (self.models is None or not self.models.is_served(model)):
            names = self.served_model_names + (list(self.models.lora_requests) if self.models is not None else [])
            raise OpenAIServingError(
                f"The model `{model}` does not exist. Served models: {', '.join(names)}.",
                404,
                "model",
                "NotFoundError",
            )
        return model

    def check_prompt_len(self, num_prompt_tokens: int, max_tokens: int | None, what: str = "prompt") -> int:
        """Validates the prompt against the context; returns max_tokens (default: the rest of the context)."""
        if num_prompt_tokens == 0:
            raise OpenAIServingError(f"{what}: the prompt is empty (no tokens)", 400, what)
        if num_prompt_tokens >= self.max_model_len:
            raise OpenAIServingError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your request has "
                f"{num_prompt_tokens} input tokens, which leaves no room for output. Please reduce the length of "
                f"the input.",
                400,
                what,
            )
        room = self.max_model_len - num_prompt_tokens
        if max_tokens is None:
            return room
        if max_tokens > room:
            raise OpenAIServingError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the input, {max_tokens} in the "
                f"completion). Please reduce the length of the input or the completion.",
                400,
                "max_tokens",
            )
        return max_tokens

    def build_sampling_params(
        self,
        req: _SamplingRequest,
        max_tokens: int,
        stream: bool,
        logprobs: int | None = None,
        *,
        n: int | None = None,
        prompt_logprobs: int | None = None,
        structured_outputs: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        """SamplingParams from a request: request value, else the model's generation_config default, else
        OpenAI's default. Unsupported features give a 400 naming them, never a silent ignore. `n`
        overrides the request's (best_of samples all `best_of`)."""
        n = req.n if n is None else n
        d = self.default_sampling
        self.check_limits(req)
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(req, name)
            if v and not sampling_supports(name):
                raise OpenAIServingError(f"{name}: not supported yet (only 0 is accepted)", 400, name)
            if v is not None and not -2.0 <= v <= 2.0:
                raise OpenAIServingError(f"{name}: must be in [-2, 2], got {v}", 400, name)
        if req.repetition_penalty not in (None, 1.0) and not sampling_supports("repetition_penalty"):
            raise OpenAIServingError(
                "repetition_penalty: not supported yet (only 1.0 is accepted)", 400, "repetition_penalty"
            )
        if logprobs is not None and not sampling_supports("logprobs"):
            raise OpenAIServingError("logprobs: not supported yet", 400, "logprobs")
        logit_bias: dict[int, float] | None = None
        if req.logit_bias:
            if not sampling_supports("logit_bias"):
                raise OpenAIServingError("logit_bias: not supported yet", 400, "logit_bias")
            try:
                logit_bias = {int(k): float(v) for k, v in req.logit_bias.items()}
            except ValueError:
                raise OpenAIServingError(
                    "logit_bias: keys must be token ids (integers as strings)", 400, "logit_bias"
                ) from None
        kwargs: dict[str, Any] = {
            "n": n,
            "temperature": req.temperature if req.temperature is not None else d.get("temperature", 1.0),
            "top_p": req.top_p if req.top_p is not None else d.get("top_p", 1.0),
            "top_k": req.top_k if req.top_k is not None else d.get("top_k", 0),
            "min_p": req.min_p if req.min_p is not None else d.get("min_p", 0.0),
            "seed": req.seed,
            "max_tokens": max_tokens,
            "min_tokens": req.min_tokens,
            "stop": req.stop,
            "stop_token_ids": req.stop_token_ids,
            "ignore_eos": req.ignore_eos,
            "include_stop_str_in_output": req.include_stop_str_in_output,
            "skip_special_tokens": req.skip_special_tokens,
            "spaces_between_special_tokens": req.spaces_between_special_tokens,
            "output_kind": RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
        }
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
            v = getattr(req, name)
            if v is None and name == "repetition_penalty":
                v = d.get("repetition_penalty")
            if v is not None and sampling_supports(name):
                kwargs[name] = v
        if logprobs is not None:
            kwargs["logprobs"] = logprobs
        if prompt_logprobs is not None:
            kwargs["prompt_logprobs"] = prompt_logprobs
        if logit_bias:
            kwargs["logit_bias"] = logit_bias
        if n > self.max_n:
            what = "n" if n == req.n else "best_of"
            raise OpenAIServingError(
                f"{what}: at most {self.max_n} choices per request (the server's --max-n), got {n}", 400, what
            )
        requested, source = self.structured_outputs(req)
        if structured_outputs is not None and requested is not None:
            raise OpenAIServingError(
                f"{source}: cannot be combined with a tool_choice that constrains the output", 400, source
            )
        kwargs["structured_outputs"] = structured_outputs if structured_outputs is not None else requested
        try:
            return SamplingParams(**kwargs)
        except (ValueError, TypeError) as e:
            raise OpenAIServingError.from_value_error(e) from None

    @staticmethod
    def structured_outputs(req: _SamplingRequest) -> tuple[StructuredOutputsParams | None, str]:
        """The request's output constraint (response_format, structured_outputs or guided_*) and the field it
        came from, validated: a 400 naming the field for an invalid JSON schema, regex or grammar."""
        from pagedllm.entrypoints.openai import structured_outputs as so

        try:
            params, source = so.structured_outputs_from_request(req)
            if params is not None:
                so.check(params, source)
                params = so.as_json_text(params)
        except so.StructuredOutputsRequestError as e:
            raise OpenAIServingError(str(e), 400, e.param) from None
        return params, source

    def token_text(self, token_id: int, lp: Any) -> str:
        decoded = getattr(lp, "decoded_token", None)
        return decoded if decoded is not None else self.engine.get_tokenizer().decode([token_id])

    def completion_logprobs(
        self,
        out: CompletionOutput,
        text_offset0: int,
        prompt_token_ids: list[int] | None = None,
        prompt_logprobs: PromptLogprobs | None = None,
    ) -> CompletionLogProbs | None:
        """OpenAI's legacy completion logprobs of `out`'s tokens (offsets from `text_offset0`), preceded
        (echo) by the prompt's when `prompt_logprobs` is given: the first prompt token has null
        `token_logprobs` and `top_logprobs` entries, as OpenAI and vLLM (nothing predicts it)."""
        if out.logprobs is None:
            return None
        res = CompletionLogProbs()
        offset = text_offset0
        steps: list[tuple[int, dict[int, Logprob] | None]] = []
        if prompt_token_ids is not None and prompt_logprobs is not None:
            steps.extend(zip(prompt_token_ids, prompt_logprobs))
        steps.extend(zip(out.token_ids, out.logprobs))
        for tid, pos in steps:
            lp = pos.get(tid) if pos is not None else None
            tok = self.token_text(tid, lp)
            res.tokens.append(tok)
            if pos is None:
                res.token_logprobs.append(None)
                res.top_logprobs.append(None)
            else:
                res.token_logprobs.append(_lp_value(lp))
                res.top_logprobs.append({self.token_text(t, v): _lp_value(v) for t, v in pos.items()})
            res.text_offset.append(offset)
            offset += len(tok)
        return res

    def chat_logprobs(self, out: CompletionOutput, top: int) -> ChatCompletionLogProbs | None:
        if out.logprobs is None:
            return None
        content: list[ChatCompletionLogProb] = []
        for tid, pos in zip(out.token_ids, out.logprobs):
            lp = pos.get(tid)
            tok = self.token_text(tid, lp)
            tops = sorted(pos.items(), key=lambda kv: -_lp_value(kv[1]))[: top if top >= 0 else None]  # -1: all
            content.append(
                ChatCompletionLogProb(
                    token=tok,
                    logprob=_lp_value(lp),
                    bytes=list(tok.encode("utf-8")),
                    top_logprobs=[
                        TopLogprob(
                            token=(t := self.token_text(i, v)), logprob=_lp_value(v), bytes=list(t.encode("utf-8"))
                        )
                        for i, v in tops
                    ],
                )
            )
        return ChatCompletionLogProbs(content=content)

    @staticmethod
    def usage(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
        return UsageInfo(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


def _lp_value(lp: Any) -> float:
    if lp is None:
        return float("-inf")
    v = float(getattr(lp, "logprob", lp))
    return max(v, -9999.0)  # JSON has no -inf; OpenAI clients expect a number
