"""AsyncLLM: the asyncio front end of an engine core running in its own process (vLLM v1's AsyncLLM).

    engine = AsyncLLM.from_engine_args(EngineArgs())
    async for out in engine.generate("Hello", SamplingParams(output_kind=RequestOutputKind.DELTA), "req-1"):
        print(out.outputs[0].text, end="")

The front end owns tokenization (`InputProcessor`), detokenization, stop strings and parallel sampling
(`OutputProcessor`); the core process owns scheduling and the model. One asyncio task (the output
handler) reads each step's `EngineCoreOutputs`, runs the output processor, which puts every request's
`RequestOutput` into that request's `RequestOutputCollector`, and records metrics. `generate` only
waits on its collector, so the event loop never waits on a model step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.controls import AsyncLLMControlsMixin
from pagedllm.engine.exceptions import RequestFailedError, RequestTimeoutError
from pagedllm.engine.input_processor import InputProcessor
from pagedllm.engine.llm_engine import load_tokenizer
from pagedllm.engine.mp_client import AsyncMPClient, CoreConnection, EngineDeadError
from pagedllm.engine.output_collector import RequestOutputCollector
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.parallel_sampling import ParentRequest
from pagedllm.inputs import PromptType
from pagedllm.logger import init_logger
from pagedllm.lora.request import LoRARequest
from pagedllm.messages import EngineCoreOutputs
from pagedllm.metrics.loggers import LoggingStatLogger, StatLogger
from pagedllm.metrics.stats import IterationStats
from pagedllm.outputs import PoolingRequestOutput, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams

logger = init_logger(__name__)

OUTPUT_CHUNK_SIZE = 128
"""Core outputs processed per slice before yielding to the event loop (a 256-request step would
otherwise hold the loop for the whole detokenization pass)."""

LARGE_TEXT_CHARS = 4096
"""Texts longer than this are tokenized in a worker thread instead of on the event loop."""

__all__ = ["AsyncLLM", "EngineDeadError"]


class AsyncLLM(AsyncLLMControlsMixin):
    def __init__(
        self,
        config: EngineConfig,
        log_stats: bool = True,
        stat_loggers: Sequence[StatLogger] | None = None,
        log_interval_s: float = 10.0,
        core_connections: list[CoreConnection] | None = None,
    ) -> None:
        """`core_connections`: use the engine cores (one per data-parallel rank) another process started (one of
        several API servers) instead of starting them."""
        self.config = config
        self.model_config = config.model_config
        self.tokenizer = load_tokenizer(config)
        self.input_processor = InputProcessor(
            config.model_config,
            self.tokenizer,
            lora_config=config.lora_config,
            speculative=config.speculative_config is not None,
            structured_outputs_config=config.structured_outputs_config,
            multimodal_config=config.multimodal_config,
        )
        self.log_stats = log_stats
        self.stat_loggers: list[StatLogger] = list(stat_loggers or [])
        if log_stats and not any(isinstance(s, LoggingStatLogger) for s in self.stat_loggers):
            self.stat_loggers.append(LoggingStatLogger())
        self.output_processor = OutputProcessor(self.tokenizer, log_stats=bool(self.stat_loggers))
        self.log_interval_s = log_interval_s
        # Tokenizing a huge prompt takes a while; do it off the event loop, one at a time (2 cores).
        self._tokenize_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pagedllm-tokenize")
        if config.parallel_config.data_parallel_size > 1:  # N cores behind this front end
            from pagedllm.engine.dp_client import DPAsyncMPClient

            self.engine_core: AsyncMPClient = DPAsyncMPClient(config, core_connections)  # type: ignore[assignment]
        else:
            self.engine_core = AsyncMPClient(config, connect=core_connections[0] if core_connections else None)
        self.engine_core.on_dead = self._fail_all_requests
        self.dead_callbacks: list[Callable[[EngineDeadError], None]] = []
        """Called (on the event loop) once the core process is found dead, after requests were failed."""
        self.request_timeout_s: float | None = None
        """Abort a request that has not finished this many seconds after it was added (`RequestTimeoutError`
        for its reader); None: no limit. The server's `--request-timeout`."""
        self._deadlines: dict[str, asyncio.TimerHandle] = {}
        self._timed_out: set[str] = set()
        self._output_handler: asyncio.Task[None] | None = None
        self._log_task: asyncio.Task[None] | None = None
        self._last_step_ts = 0.0
        self._shutdown = False

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **kwargs: Any) -> AsyncLLM:
        kwargs.setdefault("log_stats", not engine_args.disable_log_stats)
        return cls(engine_args.create_engine_config(), **kwargs)

    # ---- state ------------------------------------------------------------------------------------
    @property
    def errored(self) -> bool:
        return self.engine_core.dead

    @property
    def is_running(self) -> bool:
        return not self._shutdown and not self.engine_core.dead

    @property
    def dead_error(self) -> EngineDeadError:
        return self.engine_core.dead_error or EngineDeadError()

    def get_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise ValueError("tokenizer: not loaded (skip_tokenizer_init=True)")
        return self.tokenizer

    def get_default_sampling_params(self) -> dict[str, Any]:
        """Sampling defaults from the model's generation_config.json (vLLM applies them under the request's)."""
        return self.model_config.get_diff_sampling_param()

    async def check_health(self) -> None:
        if not self.engine_core.is_alive():
            raise self.dead_error

    # ---- requests -------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the output handler in the running loop (idempotent; `generate` calls it)."""
        if self._output_handler is not None:
            return
        loop = asyncio.get_running_loop()
        self.engine_core.start(loop)
        self._output_handler = loop.create_task(self._run_output_handler(), name="AsyncLLM.output_handler")
        if self.stat_loggers and self.log_interval_s > 0:
            self._log_task = loop.create_task(self._run_log_loop(), name="AsyncLLM.log_stats")

    async def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Tokenize `text`; large texts are tokenized in a worker thread."""
        tok = self.get_tokenizer()
        if len(text) <= LARGE_TEXT_CHARS:
            return list(tok.encode(text, add_special_tokens=add_special_tokens))
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._tokenize_pool, lambda: list(tok.encode(text, add_special_tokens=add_special_tokens))
        )

    async def run_in_worker(self, fn: Any, *args: Any) -> Any:
        """Run a blocking front-end function (chat-template rendering, decoding) off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, fn, *args)

    async def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> RequestOutputCollector:
        """Queue a request; its outputs arrive in the returned collector. Raises ValueError for bad input."""
        self.start()
        if self.engine_core.dead:
            raise self.dead_error
        self.check_can_run()  # controls: not while asleep
        if arrival_time is None:
            arrival_time = time.monotonic()
        if isinstance(prompt, str) and len(prompt) > LARGE_TEXT_CHARS:
            prompt = {"prompt": prompt, "prompt_token_ids": await self.encode_text(prompt)}  # type: ignore[typeddict-item]
        if request_id in self.output_processor.request_states or request_id in self.output_processor.parent_requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        req, prompt_text = self.input_processor.process(
            request_id, prompt, params, arrival_time, priority, lora_request=lora_request
        )
        queue = RequestOutputCollector(params.output_kind)
        if self.request_timeout_s is not None:
            self._deadlines[request_id] = asyncio.get_running_loop().call_later(
                self.request_timeout_s, self._expire, request_id
            )
        if params.n == 1:
            self.output_processor.add_request(req, prompt_text, queue=queue)
            core_reqs = [req]
        else:
            parent = ParentRequest(request_id, req.sampling_params)
            core_reqs = parent.make_child_requests(req)
            for idx, child in enumerate(core_reqs):
                self.output_processor.add_request(child, prompt_text, parent, idx, queue=queue)
        try:
            for core_req in core_reqs:
                self.engine_core.add_request(core_req)
        except BaseException:  # the core never got (all of) it: forget it here, drop any part that was sent
            self.abort(request_id)
            raise
        return queue

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield the request's `RequestOutput`s as the engine produces them (per `output_kind`).

        Closing or cancelling the generator (client disconnect) aborts the request in the engine, which
        frees its KV blocks. Raises `EngineDeadError` if the core process dies meanwhile.
        """
        queue = await self.add_request(request_id, prompt, sampling_params, arrival_time, priority, lora_request)
        stream = self.stream_outputs(request_id, queue)
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()  # closed at our yield: abort now rather than at garbage collection

    async def stream_outputs(
        self, request_id: str, queue: RequestOutputCollector
    ) -> AsyncGenerator[RequestOutput, None]:
        """The outputs of a request queued by `add_request` (for callers that validate all their requests
        before streaming any). Closing or cancelling the generator aborts the request."""
        finished = False
        try:
            while not finished:
                out = queue.get_nowait() or await queue.get()
                finished = out.finished
                if finished:
                    if request_id in self._timed_out:
                        self._timed_out.discard(request_id)
                        raise RequestTimeoutError(request_id, self.request_timeout_s or 0.0)
                    if isinstance(out, RequestOutput):  # (pooling outputs carry no finish reason)
                        for o in out.outputs:
                            if o.finish_reason == "error":
                                raise RequestFailedError(request_id, str(o.stop_reason))
                yield out
        except EngineDeadError:
            raise
        except BaseException:  # CancelledError / GeneratorExit (disconnect) or an error: free the request
            if not finished:
                self.abort(request_id)
            raise
        finally:
            deadline = self._deadlines.pop(request_id, None) if self._deadlines else None
            if deadline is not None:
                deadline.cancel()

    def _expire(self, request_id: str) -> None:
        """The request's time limit passed: abort it; its reader gets `RequestTimeoutError`."""
        op = self.output_processor
        if self._deadlines.pop(request_id, None) is None:
            return
        if request_id not in op.request_states and request_id not in op.parent_requests:
            return  # finished already; its reader has not read the last output yet
        self._timed_out.add(request_id)
        self.abort(request_id)

    async def encode(
        self,
        prompt: PromptType,
        pooling_params: PoolingParams,
        request_id: str,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> AsyncGenerator[PoolingRequestOutput, None]:
        """Pooling (embed / classify / score ...): yields the request's one `PoolingRequestOutput`."""
        queue = await self.add_request(request_id, prompt, pooling_params, arrival_time, priority)  # type: ignore[arg-type]
        async for out in self.stream_outputs(request_id, queue):
            yield out  # type: ignore[misc]

    def abort(self, request_id: str | Sequence[str]) -> None:
        """Abort requests (parent or core ids); synchronous so generator cleanup can call it."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        op = self.output_processor
        stats = IterationStats(iteration_timestamp=time.monotonic()) if self.stat_loggers else None
        core_ids = op.abort_requests(ids, stats)
        self.engine_core.abort_requests(core_ids)
        if stats is not None and stats.finished_requests:
            self._record(None, stats, [])  # aborts count in request_success{finished_reason="abort"}

    async def reset_prefix_cache(self) -> bool:
        self.start()
        return bool(await self.engine_core.call_utility("reset_prefix_cache"))

    # ---- output handling ------------------------------------------------------------------------
    async def _run_output_handler(self) -> None:
        op = self.output_processor
        client = self.engine_core
        try:
            while True:
                outputs: EngineCoreOutputs = await client.get_output()
                core_outs = outputs.outputs
                queue_times = self._queue_times(outputs) if self.stat_loggers else []
                if not core_outs:
                    self._record(outputs, None, queue_times)
                for start in range(0, len(core_outs), OUTPUT_CHUNK_SIZE):
                    chunk = core_outs[start : start + OUTPUT_CHUNK_SIZE]
                    processed = op.process_outputs(chunk, outputs.timestamp)
                    client.abort_requests(processed.reqs_to_abort)
                    last = start + OUTPUT_CHUNK_SIZE >= len(core_outs)
                    self._record(outputs if last else None, processed.iteration_stats, queue_times if last else [])
                    if not last:
                        await asyncio.sleep(0)
                self._last_step_ts = outputs.timestamp
        except asyncio.CancelledError:
            raise
        except EngineDeadError:
            pass  # already reported: every in-flight request was failed by _fail_all_requests
        except Exception as e:
            logger.exception("AsyncLLM output handler failed")
            client.mark_dead(EngineDeadError(f"The engine's output handler failed: {type(e).__name__}: {e}"))

    def _queue_times(self, outputs: EngineCoreOutputs) -> list[float]:
        """Approximate queue time of requests that got their first token in this step: from arrival to
        the start of this step, taken as the end of the previous one (the core steps back to back while
        busy). A prefill chunked over several steps counts its earlier chunks as queueing; the exact
        value needs the core's scheduling timestamps, which EngineCoreOutput does not carry yet."""
        states = self.output_processor.request_states
        prev = self._last_step_ts
        times: list[float] = []
        for out in outputs.outputs:
            if not out.new_token_ids:
                continue
            state = states.get(out.request_id)
            if state is not None and state.metrics.first_token_time is None:
                times.append(max(0.0, prev - state.metrics.arrival_time))
        return times

    def _record(self, outputs: EngineCoreOutputs | None, iteration_stats: Any, queue_times: list[float]) -> None:
        sched = outputs.scheduler_stats if outputs is not None else None
        if sched is None and iteration_stats is None and not queue_times:
            return
        for sl in self.stat_loggers:
            sl.record(sched, iteration_stats, queue_times)

    async def _run_log_loop(self) -> None:
        while True:
            await asyncio.sleep(self.log_interval_s)
            for sl in self.stat_loggers:
                try:
                    sl.log()
                except Exception:
                    logger.exception("stat logger failed")

    def _fail_all_requests(self, error: EngineDeadError) -> None:
        """Engine dead: every reader gets the error instead of waiting forever."""
        op = self.output_processor
        for state in list(op.request_states.values()):
            if state.queue is not None:
                state.queue.put(error)
        for pstate in list(op.parent_requests.values()):
            if pstate.queue is not None:
                pstate.queue.put(error)
        op.request_states.clear()
        op.parent_requests.clear()
        for cb in self.dead_callbacks:
            try:
                cb(error)
            except Exception:
                logger.exception("engine-dead callback failed")

    # ---- shutdown -------------------------------------------------------------------------------
    def shutdown(self) -> None:
        if self._shutdown:
            return
        self._shutdown = True
        for task in (self._output_handler, self._log_task):
            if task is not None and not task.done():
                task.cancel()
        self.engine_core.shutdown()
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)
