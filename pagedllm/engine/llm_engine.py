"""LLMEngine: input processor -> engine-core client -> output processor (vLLM's layer under `LLM`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.core_client import InprocClient
from pagedllm.engine.input_processor import InputProcessor
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.parallel_sampling import ParentRequest
from pagedllm.inputs import PromptType
from pagedllm.lora.request import LoRARequest
from pagedllm.messages import SchedulerStats
from pagedllm.outputs import RequestOutput
from pagedllm.sample.logits_processor import LogitsProcessor
from pagedllm.sampling_params import SamplingParams
from pagedllm.transformers_utils.tokenizer import model_tokenizer


def load_tokenizer(config: EngineConfig) -> Any | None:
    """The front end's tokenizer; None with `skip_tokenizer_init`."""
    return None if config.model_config.skip_tokenizer_init else model_tokenizer(config.model_config)


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        log_stats: bool = False,
        logits_processors: list[LogitsProcessor] | None = None,
    ) -> None:
        if config.parallel_config.data_parallel_size > 1:
            raise ValueError(
                "data_parallel_size: the offline engine runs one engine core; data parallelism is for "
                "AsyncLLM / `pagedllm serve --data-parallel-size N`"
            )
        self.config = config
        self.model_config = config.model_config
        self.tokenizer = load_tokenizer(config)
        self.input_processor = InputProcessor(
            config.model_config,
            self.tokenizer,
            logits_processors,
            config.lora_config,
            speculative=config.speculative_config is not None,
            structured_outputs_config=config.structured_outputs_config,
            multimodal_config=config.multimodal_config,
        )
        self.output_processor = OutputProcessor(self.tokenizer, log_stats=log_stats)
        self.engine_core = InprocClient(config, logits_processors)
        self.last_scheduler_stats: SchedulerStats | None = None
        self.prometheus = None
        """The metrics `LLM.get_metrics()` reads (with log_stats), in a registry of its own."""
        if log_stats:
            from pagedllm.metrics.prometheus import PrometheusStatLogger

            self.prometheus = PrometheusStatLogger(config.model_config.model, config.model_config.max_model_len)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **kwargs: Any) -> LLMEngine:
        return cls(engine_args.create_engine_config(), log_stats=not engine_args.disable_log_stats, **kwargs)

    def get_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise ValueError("tokenizer: not loaded (skip_tokenizer_init=True)")
        return self.tokenizer

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queues a request. `n > 1` fans out into n child requests sharing the prompt's KV blocks
        through the prefix cache; their outputs come back gathered under `request_id`."""
        req, prompt_text = self.input_processor.process(
            request_id, prompt, params, arrival_time, priority, lora_request=lora_request
        )
        if params.n == 1:
            self.output_processor.add_request(req, prompt_text)
            self.engine_core.add_request(req)
            return
        parent = ParentRequest(request_id, req.sampling_params)
        for idx, child in enumerate(parent.make_child_requests(req)):
            self.output_processor.add_request(child, prompt_text, parent, idx)
            self.engine_core.add_request(child)

    def step(self) -> list[RequestOutput]:
        outputs = self.engine_core.get_output()
        self.last_scheduler_stats = outputs.scheduler_stats
        processed = self.output_processor.process_outputs(outputs.outputs, outputs.timestamp)
        if self.prometheus is not None:
            self.prometheus.record(outputs.scheduler_stats, processed.iteration_stats)
        self.engine_core.abort_requests(processed.reqs_to_abort)
        return processed.request_outputs

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.engine_core.abort_requests(self.output_processor.abort_requests(ids))

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()
