"""The engine front end (LLMEngine, AsyncLLM), its core client and the engine core. The messages between
them live in `pagedllm.messages` (re-exported here)."""

from pagedllm.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    SchedulerStats,
)

__all__ = ["EngineCoreOutput", "EngineCoreOutputs", "EngineCoreRequest", "FinishReason", "SchedulerStats"]
