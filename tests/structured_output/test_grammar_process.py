"""The grammar server process in the engine on the CPU (the same protocol as on CUDA, the flags waited for on the
host): see `grammar_process_case.py`."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("xgrammar")

from tests.structured_output.grammar_process_case import run_engine_case  # noqa: E402


def _server_mode_llm(monkeypatch: pytest.MonkeyPatch, smollm2_path: str) -> Any:
    """A tiny SmolLM2-shaped engine on the CPU with the grammar server process (forced: the CPU's default is the
    worker thread)."""
    from pagedllm import LLM
    from pagedllm.benchmarks.workloads import TINY_OVERRIDES

    monkeypatch.setenv("PAGEDLLM_GRAMMAR_PROCESS", "1")
    return LLM(
        "benchmarks/workloads/smollm2-135m",
        tokenizer=smollm2_path,
        load_format="dummy",
        dtype="float32",
        device="cpu",
        hf_overrides=TINY_OVERRIDES,
        max_model_len=256,
        kv_cache_memory_bytes=64 << 20,
    )


def test_grammar_process_engine_cpu(monkeypatch: pytest.MonkeyPatch, smollm2_path: str) -> None:
    run_engine_case(monkeypatch, "cpu", smollm2_path)


def test_grammar_server_death_fails_structured_requests_only(
    monkeypatch: pytest.MonkeyPatch, smollm2_path: str
) -> None:
    """The grammar server dies: the structured requests fail (finish_reason "error", naming the server), the plain
    ones in the same batch finish as usual, and nothing hangs."""
    import time

    from pagedllm import SamplingParams, StructuredOutputsParams, TokensPrompt

    llm = _server_mode_llm(monkeypatch, smollm2_path)
    so = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["a", "b"]))
    prompt = [TokensPrompt(prompt_token_ids=[5, 6, 7])]
    assert llm.generate(prompt, so, use_tqdm=False)[0].outputs[0].finish_reason == "stop"
    link = llm.llm_engine.engine_core.engine_core.scheduler.structured.link
    link.client._proc.kill()
    link.client._proc.wait()
    plain = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    t = time.monotonic()
    outs = llm.generate(prompt * 4, [so, plain, so, plain], use_tqdm=False)
    assert time.monotonic() - t < 20
    for o in (outs[0], outs[2]):
        assert o.outputs[0].finish_reason == "error"
    for o in (outs[1], outs[3]):
        assert o.outputs[0].finish_reason == "length" and len(o.outputs[0].token_ids) == 8


def test_idle_grammar_server_started_with_the_engine_closes_with_it(
    monkeypatch: pytest.MonkeyPatch, smollm2_path: str
) -> None:
    """The server process starts with the engine (its imports done before the first structured request); an engine
    that never saw a structured request closes it at shutdown, and one that did closes the running server."""
    from pagedllm import SamplingParams, StructuredOutputsParams, TokensPrompt

    for structured in (False, True):
        llm = _server_mode_llm(monkeypatch, smollm2_path)
        manager = llm.llm_engine.engine_core.engine_core.scheduler.structured
        proc = manager._unused.__self__.proc  # the ServerProcess started with the engine
        assert proc.poll() is None
        if structured:
            so = StructuredOutputsParams(choice=["a", "b"])
            sp = SamplingParams(temperature=0.0, max_tokens=4, structured_outputs=so)
            out = llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7])], sp, use_tqdm=False)[0]
            assert out.outputs[0].text in ("a", "b")
            assert manager.link.client._proc is proc
        manager.shutdown()
        assert proc.wait(timeout=10) == 0
