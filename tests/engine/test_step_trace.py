"""PAGEDLLM_STEP_TRACE: the engine core's per-step trace (engine/step_trace.py) names every request's arrival,
the step that first scheduled it and the step that gave its first token, in order, and changes no output."""

from __future__ import annotations

import json

import pytest

from pagedllm import LLM, SamplingParams, TokensPrompt
from tests.executor.parallel_utils import tiny_prompts
from tests.utils_model import make_tiny_hf_model


def _run(model_dir: str) -> list[list[int]]:
    llm = LLM(
        model=model_dir, dtype="float32", skip_tokenizer_init=True, max_model_len=128,
        kv_cache_memory_bytes=8 << 20, max_num_batched_tokens=16,
    )  # fmt: skip
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in tiny_prompts()], sp, use_tqdm=False)
    llm.llm_engine.engine_core.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs]


def test_step_trace(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    make_tiny_hf_model("llama", tmp_path / "m")
    plain = _run(str(tmp_path / "m"))
    trace = tmp_path / "trace.jsonl"
    monkeypatch.setenv("PAGEDLLM_STEP_TRACE", str(trace))
    assert _run(str(tmp_path / "m")) == plain
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    adds = [e["id"] for e in events if e["ev"] == "add"]
    sched = {e["step"]: e for e in events if e["ev"] == "sched"}
    done = {e["step"]: e for e in events if e["ev"] == "done"}
    assert len(adds) == len(tiny_prompts()) and set(sched) == set(done)
    first_sched = {rid: k for k in sorted(sched) for rid in sched[k]["new"]}
    first_token = {rid: k for k in sorted(done) for rid in done[k]["first"]}
    assert set(first_sched) == set(first_token) == set(adds)
    for rid in adds:
        assert first_sched[rid] <= first_token[rid]
    # A 16-token budget chunks the longer prompts: some step carries prefill tokens, and times only grow.
    assert any(s["prefill_tokens"] > 1 for s in sched.values())
    assert all(sched[k]["tokens"] <= 16 for k in sched)
    times = [e["t"] for e in events if e["ev"] != "gc"]
    assert times == sorted(times)
