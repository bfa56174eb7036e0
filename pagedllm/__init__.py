"""pagedllm: a high-throughput, memory-efficient LLM inference and serving engine."""

from pagedllm.beam_search import BeamSearchOutput, BeamSearchSequence
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.llm import LLM
from pagedllm.inputs import TextPrompt, TokensPrompt
from pagedllm.logprobs import Logprob
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sample.logits_processor import LogitsProcessor
from pagedllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"

__all__ = [
    "LoRARequest",
    "LLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "CompletionOutput",
    "EngineArgs",
    "LLMEngine",
    "Logprob",
    "LogitsProcessor",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "StructuredOutputsParams",
    "TextPrompt",
    "TokensPrompt",
    "__version__",
]
