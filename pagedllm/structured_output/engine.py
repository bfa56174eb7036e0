"""Building the engine core's `StructuredOutputManager` from the engine config."""

from __future__ import annotations

from pagedllm.config import EngineConfig
from pagedllm.structured_output.backend import XgrammarBackend
from pagedllm.structured_output.config import StructuredOutputsConfig
from pagedllm.structured_output.manager import StructuredOutputManager


def make_structured_output_manager(config: EngineConfig) -> StructuredOutputManager:
    """The manager of an engine core. Cheap: the tokenizer and xgrammar's vocabulary are read in a compile
    thread when the first structured request arrives, never on the step loop."""
    so_config = config.structured_outputs_config or StructuredOutputsConfig()
    mc = config.model_config

    def backend() -> XgrammarBackend:
        from pagedllm.engine.llm_engine import load_tokenizer

        tokenizer = load_tokenizer(config)
        stops = list(mc.eos_token_ids)
        if getattr(tokenizer, "eos_token_id", None) is not None and tokenizer.eos_token_id not in stops:
            stops.insert(0, int(tokenizer.eos_token_id))
        return XgrammarBackend(tokenizer, mc.vocab_size, stops, so_config)

    reasoning = None
    if so_config.reasoning_parser:
        from pagedllm.reasoning import get_reasoning_parser

        parser_cls = get_reasoning_parser(so_config.reasoning_parser)

        def reasoning():  # type: ignore[no-untyped-def]  # noqa: ANN202
            from pagedllm.engine.llm_engine import load_tokenizer

            return parser_cls(load_tokenizer(config))

    return StructuredOutputManager(so_config, backend, mc.vocab_size, reasoning)
