"""pagedllm: a high-throughput, memory-efficient LLM inference and serving engine."""

from pagedllm import envs

envs.set_openmp_defaults()  # before anything imports torch (and with it OpenMP)

from pagedllm.beam_search import BeamSearchOutput, BeamSearchSequence
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.llm import LLM
from pagedllm.inputs import TextPrompt, TokensPrompt
from pagedllm.logprobs import Logprob
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import (
    ClassificationRequestOutput,
    CompletionOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringRequestOutput,
)
from pagedllm.pooling_params import PoolingParams
from pagedllm.sample.logits_processor import LogitsProcessor
from pagedllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"

__all__ = [
    "LoRARequest",
    "LLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "ClassificationRequestOutput",
    "CompletionOutput",
    "EmbeddingRequestOutput",
    "EngineArgs",
    "LLMEngine",
    "Logprob",
    "PoolingParams",
    "PoolingRequestOutput",
    "LogitsProcessor",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "ScoringRequestOutput",
    "StructuredOutputsParams",
    "TextPrompt",
    "TokensPrompt",
    "__version__",
]
