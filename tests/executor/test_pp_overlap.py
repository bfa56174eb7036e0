"""Pipeline parallelism with several batches in flight (the engine core's batch queue, gloo on the CPU):
greedy outputs equal tp=1's with many requests (chunked prefills, shared prefixes, stop tokens), the
batch queue really held two launched batches at once, and preemption and aborts still work."""

from __future__ import annotations

import random
from typing import Any

import pytest

from pagedllm import LLM, SamplingParams, TokensPrompt
from tests.executor.parallel_utils import NEAR_TIE, assert_same_outputs
from tests.utils_model import VOCAB, make_tiny_hf_model

MAX_TOKENS = 10


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("llama_pp")
    make_tiny_hf_model("llama", path)
    return str(path)


def many_prompts(n: int = 24) -> list[list[int]]:
    """Mixed lengths (some longer than the 32-token step budget: chunked prefills) and a shared 20-token
    prefix on a third of them (prefix-cache hits)."""
    rng = random.Random(1)
    prefix = [rng.randrange(VOCAB) for _ in range(20)]
    out = []
    for i in range(n):
        own = [rng.randrange(VOCAB) for _ in range(rng.randrange(2, 45))]
        out.append(prefix + own if i % 3 == 0 else own)
    return out


def params(i: int) -> SamplingParams:
    # Every fourth request may stop early on a stop token (the scheduler's stop path under the batch queue).
    stop = [7, 11, 13] if i % 4 == 0 else None
    return SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False, logprobs=2, stop_token_ids=stop
    )


def make_llm(path: str, **kwargs: Any) -> LLM:
    args: dict[str, Any] = {
        "dtype": "float32",
        "skip_tokenizer_init": True,
        "max_model_len": 128,
        "kv_cache_memory_bytes": 8 << 20,
        "max_num_batched_tokens": 32,
        "max_num_seqs": 8,
        **kwargs,
    }
    return LLM(path, **args)


def generate(llm: LLM, prompts: list[list[int]]) -> list[Any]:
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts], [params(i) for i in range(len(prompts))], use_tqdm=False
    )
    return [o.outputs[0] for o in outs]


@pytest.fixture(scope="module")
def reference(checkpoint: str) -> list[Any]:
    llm = make_llm(checkpoint)
    try:
        return generate(llm, many_prompts())
    finally:
        llm.llm_engine.engine_core.shutdown()


def run_pp(path: str, prompts: list[list[int]], **kwargs: Any) -> tuple[list[Any], Any]:
    """Outputs, and the engine core (for its batch queue's and scheduler's counters), shut down."""
    llm = make_llm(path, pipeline_parallel_size=2, **kwargs)
    core = llm.llm_engine.engine_core.engine_core
    try:
        return generate(llm, prompts), core
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_pp2_batch_queue_matches_tp1(checkpoint: str, reference: list[Any]) -> None:
    got, core = run_pp(checkpoint, many_prompts())
    assert_same_outputs(reference, got)
    bq = core.batch_queue
    assert bq is not None and bq.max_batches == 2
    assert bq.max_in_flight == 2, "two batches were never in flight at once"
    assert bq.num_overlapped_launches > 10
    assert core.scheduler.kv.prefix_cache_hits > 0
    assert any(r.finish_reason == "stop" for r in got)


def test_pp2_one_batch_at_a_time_when_turned_off(
    checkpoint: str, reference: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAGEDLLM_MAX_CONCURRENT_BATCHES", "1")
    got, core = run_pp(checkpoint, many_prompts()[:8])
    assert_same_outputs(reference[:8], got)
    assert core.batch_queue.max_in_flight == 1 and core.batch_queue.num_overlapped_launches == 0


def test_pp2_batch_queue_with_preemption(checkpoint: str, reference: list[Any]) -> None:
    """A KV cache of 24 blocks of 16 tokens for 8 running requests of up to ~75 tokens: requests are
    preempted (recomputed later) while others are in flight."""
    got, core = run_pp(checkpoint, many_prompts(), num_gpu_blocks_override=24, schedule_conservativeness=0.0)
    assert_same_outputs(reference, got)
    assert core.scheduler.num_preemptions > 0
    assert core.batch_queue.max_in_flight == 2


def test_pp2_batch_queue_abort(checkpoint: str, reference: list[Any]) -> None:
    """Aborting requests while batches are in flight: they end, every other request is unaffected."""
    prompts = many_prompts()
    llm = make_llm(checkpoint, pipeline_parallel_size=2)
    engine = llm.llm_engine
    try:
        for i, p in enumerate(prompts):
            engine.add_request(str(i), TokensPrompt(prompt_token_ids=p), params(i))
        aborted = {"1", "2", "5", "13"}
        done: dict[str, Any] = {}
        steps = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0]
            steps += 1
            if steps == 4:
                assert len(engine.engine_core.engine_core.batch_queue.queue) > 0
                engine.abort_request(list(aborted))
        assert steps < 500
        assert not aborted & set(done)
        keep = [i for i in range(len(prompts)) if str(i) not in aborted]
        assert_same_outputs([reference[i] for i in keep], [done[str(i)] for i in keep])
        core = engine.engine_core.engine_core
        assert not core.scheduler.requests and not core.batch_queue.queue
    finally:
        engine.engine_core.shutdown()


@pytest.mark.slow
def test_tp2_pp2_batch_queue_matches_tp1(checkpoint: str, reference: list[Any]) -> None:
    got, core = run_pp(checkpoint, many_prompts(), tensor_parallel_size=2)
    assert_same_outputs(reference, got)
    assert core.batch_queue.max_in_flight == 2


@pytest.mark.slow
def test_smollm2_pp2_stop_strings(smollm2_path: str) -> None:
    """Stop strings (matched by the front end's detokenizer, which then aborts the request in the engine
    core while its next batch may be in flight) give the same text at pp=2 with the batch queue as at tp=1."""
    prompts = [
        "Write one sentence about the sea.",
        "List three colours, separated by commas:",
        "What is 2 + 2? Answer:",
        "Name a planet.",
        "Say hello in French.",
        "Describe a cat in a few words.",
    ]
    sp = SamplingParams(temperature=0.0, max_tokens=24, stop=[".", ","], logprobs=2)
    kw: dict[str, Any] = {"dtype": "float32", "max_model_len": 256, "kv_cache_memory_bytes": 32 << 20,
                          "gguf_dequantize": True, "max_num_seqs": 4}  # fmt: skip
    texts = {}
    for pp in (1, 2):
        llm = LLM(smollm2_path, pipeline_parallel_size=pp, **kw)
        try:
            outs = llm.generate(prompts, sp, use_tqdm=False)
            texts[pp] = [o.outputs[0] for o in outs]
            if pp == 2:
                assert llm.llm_engine.engine_core.engine_core.batch_queue.max_in_flight == 2
        finally:
            llm.llm_engine.engine_core.shutdown()
    assert any(r.finish_reason == "stop" and r.stop_reason is not None for r in texts[1])
    for ref, got in zip(texts[1], texts[2], strict=True):
        r_ids, g_ids = list(ref.token_ids), list(got.token_ids)
        if r_ids == g_ids:
            assert (got.text, got.finish_reason, got.stop_reason) == (ref.text, ref.finish_reason, ref.stop_reason)
            continue
        step = next((i for i, (a, b) in enumerate(zip(r_ids, g_ids)) if a != b), None)
        assert step is not None, f"same tokens up to {min(len(r_ids), len(g_ids))}, different stops"
        # A divergence passes only at a near tie of the reference.
        top = sorted((lp.logprob for lp in ref.logprobs[step].values()), reverse=True)
        assert top[0] - top[1] < NEAR_TIE, f"diverges at step {step} with a top-2 gap of {top[0] - top[1]:.2e}"
