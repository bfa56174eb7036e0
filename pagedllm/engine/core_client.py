"""How the front end talks to the engine core. In-process for the offline LLM; the serving issue adds a
client for a core in its own process behind the same methods."""

from __future__ import annotations

from pagedllm.config import EngineConfig
from pagedllm.engine.core import EngineCore
from pagedllm.messages import EngineCoreOutputs, EngineCoreRequest
from pagedllm.sample.logits_processor import LogitsProcessor


class InprocClient:
    def __init__(self, config: EngineConfig, logits_processors: list[LogitsProcessor] | None = None) -> None:
        self.engine_core = EngineCore(config, logits_processors)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.engine_core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        return self.engine_core.step()

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def shutdown(self) -> None:
        self.engine_core.shutdown()
