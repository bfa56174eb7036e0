"""Building the engine core's `StructuredOutputManager` from the engine config."""

from __future__ import annotations

import functools
from typing import Any

from pagedllm import envs
from pagedllm.config import EngineConfig
from pagedllm.structured_output.backend import XgrammarBackend, tokenizer_info
from pagedllm.structured_output.config import StructuredOutputsConfig
from pagedllm.structured_output.manager import StructuredOutputManager

FILL_THREADS = 1
"""xgrammar's batch-fill threads. Its default (half the cores) is slower for one step's rows: 64 rows inside a JSON
string on two H100 hosts took 0.38 / 0.57 ms with 1 thread, 0.39 / 0.95 with 4 and 0.63 / 2.13 with 8 (NOTES,
session 12). Overridden by PAGEDLLM_GRAMMAR_FILL_THREADS."""


def _load_tokenizer(config: EngineConfig) -> Any:
    """The engine's tokenizer (as the front end loads it; cached per process by `get_tokenizer`)."""
    from pagedllm.transformers_utils.tokenizer import model_tokenizer

    return model_tokenizer(config.model_config)


def _stop_ids(config: EngineConfig, tokenizer: Any) -> list[int]:
    """The grammars' stop tokens: the model's EOS ids, the tokenizer's first."""
    stops = list(config.model_config.eos_token_ids)
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None and eos not in stops:
        stops.insert(0, int(eos))
    return stops


def make_structured_output_manager(config: EngineConfig) -> StructuredOutputManager:
    """The manager of an engine core. Cheap: the tokenizer and xgrammar's vocabulary are read in a compile
    thread when the first structured request arrives, never on the step loop."""
    so_config = config.structured_outputs_config or StructuredOutputsConfig()
    mc = config.model_config

    def backend() -> XgrammarBackend:
        tokenizer = _load_tokenizer(config)
        return XgrammarBackend(tokenizer, mc.vocab_size, _stop_ids(config, tokenizer), so_config)

    reasoning = None
    if so_config.reasoning_parser:
        from pagedllm.reasoning import get_reasoning_parser

        parser_cls = get_reasoning_parser(so_config.reasoning_parser)

        def reasoning():  # type: ignore[no-untyped-def]  # noqa: ANN202
            return parser_cls(_load_tokenizer(config))

    if grammar_process_default(config):
        return _process_manager(config, so_config, reasoning)
    return StructuredOutputManager(
        so_config,
        backend,
        mc.vocab_size,
        reasoning,
        pin_masks=str(config.device).startswith("cuda"),
        fill_threads=envs.PAGEDLLM_GRAMMAR_FILL_THREADS or FILL_THREADS,
    )


def grammar_process_default(config: EngineConfig) -> bool:
    """Whether the grammar work runs in the grammar server process (`remote.py`): on a CUDA engine whose runner
    is in this process (one device, no pipeline stages) without speculative decoding; PAGEDLLM_GRAMMAR_PROCESS
    ("1" / "0") decides otherwise. Elsewhere a worker thread does it (`manager.py`): the multiprocess executor
    ships each step's mask to its workers, and speculation verifies several tokens a step."""
    forced = envs.PAGEDLLM_GRAMMAR_PROCESS
    if forced is not None:
        return forced
    pc = config.parallel_config
    return (
        str(config.device).startswith("cuda")
        and pc.backend == "uni"
        and pc.pipeline_parallel_size == 1
        and config.speculative_config is None
    )


def _process_manager(
    config: EngineConfig, so_config: StructuredOutputsConfig, reasoning: Any
) -> StructuredOutputManager:
    from pagedllm.structured_output.client import ServerProcess
    from pagedllm.structured_output.link import ServerLink
    from pagedllm.structured_output.remote import ProcessGrammarManager
    from pagedllm.structured_output.server import ServerSpec, make_backend, server_poll_s

    mc = config.model_config
    cuda = str(config.device).startswith("cuda")

    # The server process starts with the engine and does its imports (~2 s) meanwhile; it idles (blocked on its
    # socket) until the first structured request, which then waits only for the tokenizer's info and its compile.
    process = ServerProcess()

    def start() -> ServerLink:  # in a compile thread: the tokenizer, xgrammar's view of it, the server's spec
        try:
            tokenizer = _load_tokenizer(config)
            stops = _stop_ids(config, tokenizer)
            info = tokenizer_info(tokenizer, mc.vocab_size, stops)
        except Exception:  # the requests fail (`ProcessGrammarManager._up`); the idle server goes
            process.close()
            raise
        valid = info.vocab_size
        make = functools.partial(make_backend, info.serialize_json(), mc.vocab_size, so_config)
        rows, words = config.scheduler_config.max_num_seqs, -(-valid // 32)
        spec = ServerSpec(make, rows=rows, words=words, poll_s=server_poll_s())
        return ServerLink(spec, valid, frozenset(stops), cuda, process)

    return ProcessGrammarManager(so_config, start, mc.vocab_size, reasoning, unused=process.close)
