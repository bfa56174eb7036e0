"""pagedllm: a high-throughput, memory-efficient LLM inference and serving engine."""

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.llm import LLM
from pagedllm.inputs import TextPrompt, TokensPrompt
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineArgs",
    "LLMEngine",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "TextPrompt",
    "TokensPrompt",
    "__version__",
]
