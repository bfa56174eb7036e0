"""Structured outputs end to end on the real SmolLM2 (CPU): JSON schemas, regex, choice, EBNF grammar; batches
mixing constrained and free requests; n > 1; chunked prefill, preemption and async scheduling; a reasoning
parser; a grammar that fails to compile in the engine. The full 50-prompt run is in test_structured_slow.py."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("xgrammar")
import lark  # noqa: E402

from pagedllm import LLM, SamplingParams, StructuredOutputsParams, TokensPrompt  # noqa: E402
from pagedllm.reasoning import ReasoningParser, register_reasoning_parser  # noqa: E402
from pagedllm.structured_output.backend import XgrammarBackend  # noqa: E402
from tests.structured_output.cases import (  # noqa: E402
    ARITH_EBNF,
    ARITH_LARK,
    REGEXES,
    SCHEMAS,
    check_json,
    fullmatch,
    prompts,
)

MAX_TOKENS = 160


def json_params(schema: dict, temperature: float, seed: int | None = None, **kw: object) -> SamplingParams:
    so = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=MAX_TOKENS, structured_outputs=so, **kw)


def texts(outs: list) -> list[str]:  # noqa: ANN001
    return [o.outputs[0].text for o in outs]


def test_json_schemas(smollm2_llm: LLM) -> None:
    """Every schema, greedy and sampled: every output parses and validates."""
    reqs = [
        (p, name, json_params(schema, t, seed=i))
        for name, schema in SCHEMAS.items()
        for i, p in enumerate(prompts(1))
        for t in (0.0, 1.0)
    ]
    outs = smollm2_llm.generate([p for p, _, _ in reqs], [sp for _, _, sp in reqs], use_tqdm=False)
    for (_, name, _), out in zip(reqs, outs):
        assert out.outputs[0].finish_reason == "stop", (name, out.outputs[0].text)
        check_json(out.outputs[0].text, SCHEMAS[name])


def test_json_object_regex_choice_grammar(smollm2_llm: LLM) -> None:
    choices = ["red", "green", "blue", "dark purple"]
    reqs: list[tuple[str, str, StructuredOutputsParams]] = []
    for i in range(1):
        reqs += [(f"A {k} (example {i}):", k, StructuredOutputsParams(regex=r)) for k, r in REGEXES.items()]
        reqs.append((f"Pick a colour ({i}):", "choice", StructuredOutputsParams(choice=choices)))
        reqs.append((f"An arithmetic expression ({i}):", "grammar", StructuredOutputsParams(grammar=ARITH_EBNF)))
        reqs.append(
            (
                f"A JSON object ({i}):",
                "json_object",
                StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
            )
        )
    sps = [
        SamplingParams(temperature=t, seed=7, max_tokens=MAX_TOKENS, structured_outputs=so)
        for _, _, so in reqs
        for t in (0.0, 1.0)
    ]
    outs = smollm2_llm.generate([p for p, _, _ in reqs for _ in (0, 1)], sps, use_tqdm=False)
    parser = lark.Lark(ARITH_LARK, start="start")
    for (_, kind, _so), out in zip([r for r in reqs for _ in (0, 1)], outs):
        text = out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop", (kind, text)
        if kind in REGEXES:
            assert fullmatch(REGEXES[kind], text), (kind, text)
        elif kind == "choice":
            assert text in choices
        elif kind == "grammar":
            parser.parse(text)
        else:
            assert isinstance(json.loads(text), dict)


def test_mixed_batch_leaves_free_requests_unchanged(smollm2_llm: LLM) -> None:
    """Greedy free requests give the same tokens with and without constrained requests in their batch."""
    free = prompts(4)
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    alone = smollm2_llm.generate(free, greedy, use_tqdm=False)
    schemas = [SCHEMAS["person"], SCHEMAS["rating"]]
    constrained = [json_params(s, 0.0) for s in schemas]
    mixed = smollm2_llm.generate(free + prompts(2), [greedy] * 4 + constrained, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:4]] == [o.outputs[0].token_ids for o in alone]
    for out, schema in zip(mixed[4:], schemas):
        check_json(out.outputs[0].text, schema)


def test_n_children_each_valid(smollm2_llm: LLM) -> None:
    schema = SCHEMAS["person"]
    out = smollm2_llm.generate(prompts(1), json_params(schema, 1.0, seed=3, n=4), use_tqdm=False)[0]
    assert len(out.outputs) == 4
    for c in out.outputs:
        check_json(c.text, schema)
    assert len({c.text for c in out.outputs}) > 1  # the children sample independently


def test_compile_error_fails_only_that_request(smollm2_llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """A grammar that passes the front end's check but fails to compile in the engine fails that request alone;
    a concurrent request finishes normally."""
    from pagedllm.structured_output.remote import ProcessGrammarManager

    if isinstance(smollm2_llm.llm_engine.engine_core.engine_core.scheduler.structured, ProcessGrammarManager):
        pytest.skip("the grammar server compiles in its own process (its compile errors: test_server.py)")
    real = XgrammarBackend.compile

    def compile_or_fail(self: XgrammarBackend, params: StructuredOutputsParams):  # noqa: ANN202
        if params.regex == "[a-f]{7}":
            raise RuntimeError("injected compile failure")
        return real(self, params)

    monkeypatch.setattr(XgrammarBackend, "compile", compile_or_fail)
    bad = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(regex="[a-f]{7}"))
    good = json_params(SCHEMAS["person"], 0.0)
    outs = smollm2_llm.generate(["Hex:", "A person as JSON:"], [bad, good], use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error"
    assert "injected compile failure" in str(outs[0].outputs[0].stop_reason)
    assert outs[1].outputs[0].finish_reason == "stop"
    check_json(outs[1].outputs[0].text, SCHEMAS["person"])


def test_bad_constraints_are_value_errors(smollm2_llm: LLM) -> None:
    cases = [
        (StructuredOutputsParams(json='{"type": "object", "properties": {'), "structured_outputs.json"),
        (StructuredOutputsParams(regex="(unclosed"), "structured_outputs.regex"),
        (StructuredOutputsParams(grammar="root ::= undefined_rule"), "structured_outputs.grammar"),
    ]
    for so, field in cases:
        with pytest.raises(ValueError, match=rf"^{field}: invalid"):
            smollm2_llm.generate(["x"], SamplingParams(structured_outputs=so), use_tqdm=False)


@pytest.mark.slow  # CI time: run by hand (pytest -m slow)
def test_chunked_prefill_preemption_async_equal_plain_run(smollm2_path: str, smollm2_llm: LLM) -> None:
    """Constrained outputs (greedy and seeded) under a 16-token step budget, a KV cache small enough to
    preempt, and async scheduling equal those of the plain engine."""
    long_prompts = [p + " Use realistic values and keep it short." * 3 for p in prompts(4)]
    names = ["person", "rating", "person", "rating"]
    # Greedy, and seeded sampling (its draws do not depend on the batch or on async scheduling).
    sps = [json_params(SCHEMAS[n], 0.0 if i < 2 else 1.0, seed=i) for i, n in enumerate(names)]
    free = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    ref = smollm2_llm.generate(long_prompts + ["Hello, my name is"], sps + [free], use_tqdm=False)
    llm = LLM(
        smollm2_path,
        dtype="float32",
        max_model_len=256,
        max_num_batched_tokens=16,
        num_gpu_blocks_override=20,
        schedule_conservativeness=0.0,  # admit all: the small cache preempts
        async_scheduling=True,
        gguf_dequantize=True,
    )
    got = llm.generate(long_prompts + ["Hello, my name is"], sps + [free], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    for out, n in zip(got, names):
        check_json(out.outputs[0].text, SCHEMAS[n])
    core = llm.llm_engine.engine_core.engine_core
    assert core.scheduler.num_preemptions > 0
    assert core.num_steps_ahead > 20  # constrained steps were scheduled ahead too
    # ... and their sampling waited for the engine to read the previous step (model_runner.complete_launch)
    assert core.executor.worker.model_runner.num_deferred_samplings > 10
    assert not core.scheduler.structured.states  # every matcher dropped with its request


@register_reasoning_parser("test_first4")
class FirstFourTokens(ReasoningParser):
    """Test parser: the 'reasoning' is the first four output tokens."""

    def is_reasoning_end(self, input_ids) -> bool:  # noqa: ANN001
        return len(input_ids) >= 4


def test_grammar_applies_after_reasoning(smollm2_path: str, smollm2_llm: LLM) -> None:
    llm = LLM(
        smollm2_path,
        dtype="float32",
        max_model_len=512,
        kv_cache_memory_bytes=64 << 20,
        gguf_dequantize=True,
        reasoning_parser="test_first4",
    )
    prompt = "Describe a person as JSON:"
    free = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)[0].outputs[0]
    out = llm.generate([prompt], json_params(SCHEMAS["person"], 0.0), use_tqdm=False)[0].outputs[0]
    assert out.token_ids[:4] == free.token_ids  # unconstrained while reasoning
    tok = llm.get_tokenizer()
    check_json(tok.decode(out.token_ids[4:], skip_special_tokens=True), SCHEMAS["person"])


def test_compiling_grammar_does_not_stall_others(smollm2_llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """While one request's grammar compiles (slowly, in a thread), the others are scheduled and finish."""
    import threading

    release = threading.Event()
    real = XgrammarBackend.compile

    def slow_compile(self: XgrammarBackend, params: StructuredOutputsParams):  # noqa: ANN202
        if params.regex == "[0-9]{5}":
            release.wait(60)
        return real(self, params)

    monkeypatch.setattr(XgrammarBackend, "compile", slow_compile)
    engine = smollm2_llm.llm_engine
    slow = SamplingParams(temperature=0.0, max_tokens=10, structured_outputs=StructuredOutputsParams(regex="[0-9]{5}"))
    engine.add_request("slow", "Zip code:", slow)
    engine.add_request("free", "Hello, my name is", SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    done: dict[str, object] = {}
    for _ in range(50):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if "free" in done:
            break
    assert "free" in done and "slow" not in done  # the free request ran to the end meanwhile
    release.set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert fullmatch("[0-9]{5}", done["slow"].outputs[0].text)  # type: ignore[attr-defined]


def test_finished_grammar_finishes_the_request(smollm2_llm: LLM) -> None:
    """With ignore_eos the EOS token no longer stops a request, but a grammar that has ended still does."""
    so = StructuredOutputsParams(choice=["alpha", "beta"])
    sp = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True, structured_outputs=so)
    out = smollm2_llm.generate(["Pick one:"], sp, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.text in ("alpha", "beta")
    assert len(out.token_ids) < 50


def test_async_intake_paths_equal_sync(smollm2_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Async scheduling defers a constrained step's sampling until the engine has read the previous step
    (`ModelRunner.complete_launch`), so the scheduler may feed step N's tokens to the matchers before N+1's
    mask is filled. With the intake on its worker thread and inline, the tokens go in once: greedy outputs of a
    tiny dummy model (SmolLM2's vocabulary) equal the synchronous engine's, none fails."""
    monkeypatch.setenv("PAGEDLLM_GRAMMAR_PROCESS", "0")  # the worker thread's paths
    schema = SCHEMAS["person"]
    sp = SamplingParams(
        temperature=0.0, max_tokens=24, ignore_eos=True, structured_outputs=StructuredOutputsParams(json=schema)
    )
    # Grammars that end within the run (ignore_eos: only the grammar stops them): the scheduler skips `advance` for
    # a token the worker is taking unless it is a stop token, so the step that ends a grammar must still stop its
    # request at once (the same tokens as the synchronous engine, finish_reason "stop").
    ends = sp.clone(structured_outputs=StructuredOutputsParams(regex="[a-c]{2,6}"))
    prompts_ = [TokensPrompt(prompt_token_ids=[100 + i, 200, 300 + i]) for i in range(4)]
    from pagedllm.benchmarks.workloads import TINY_OVERRIDES as tiny

    got = {}
    for name, async_on, worker in (("sync", False, True), ("worker", True, True), ("inline", True, False)):
        llm = LLM(
            "benchmarks/workloads/smollm2-135m",
            tokenizer=smollm2_path,
            load_format="dummy",
            dtype="float32",
            hf_overrides=tiny,
            max_model_len=256,
            kv_cache_memory_bytes=64 << 20,
            async_scheduling=async_on,
        )
        core = llm.llm_engine.engine_core.engine_core
        core.scheduler.structured.step_worker = worker
        outs = llm.generate(prompts_ + prompts_, [sp] * 4 + [ends] * 4, use_tqdm=False)
        reasons = [o.outputs[0].finish_reason for o in outs]
        assert reasons == ["length"] * 4 + ["stop"] * 4, reasons
        got[name] = [o.outputs[0].token_ids for o in outs]
        if async_on:
            assert core.executor.worker.model_runner.num_deferred_samplings > 10
    assert got["worker"] == got["sync"] and got["inline"] == got["sync"]
