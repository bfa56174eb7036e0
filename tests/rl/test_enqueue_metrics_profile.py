"""enqueue / wait_for_completion, get_metrics, and start_profile / stop_profile (acceptance 5)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.inputs import TokensPrompt
from pagedllm.metrics.reader import Counter, Gauge, Histogram
from tests.rl.conftest import ENGINE_KW
from tests.rl.helpers import GREEDY, assert_same, keys, run


@pytest.fixture(scope="module")
def llm(tiny_ckpts: tuple[str, str], tmp_path_factory: pytest.TempPathFactory) -> LLM:
    trace_dir = tmp_path_factory.mktemp("traces")
    return LLM(tiny_ckpts[0], profiler_config={"profiler": "torch", "torch_profiler_dir": str(trace_dir)}, **ENGINE_KW)


def test_enqueue_then_wait(llm: LLM, rl_prompts: list[list[int]]) -> None:
    assert llm.reset_prefix_cache()
    ref = run(llm, rl_prompts)
    assert llm.reset_prefix_cache()
    half = len(rl_prompts) // 2
    ids = llm.enqueue([TokensPrompt(prompt_token_ids=p) for p in rl_prompts[:half]], GREEDY)
    ids += llm.enqueue([TokensPrompt(prompt_token_ids=p) for p in rl_prompts[half:]], GREEDY)
    assert len(set(ids)) == len(rl_prompts)
    assert llm.llm_engine.get_num_unfinished_requests() == len(rl_prompts)  # queued, not run
    outs = llm.wait_for_completion(use_tqdm=False)
    assert [o.request_id for o in outs] == ids
    assert_same(keys(outs), ref)  # same batch, no cached prefixes: bitwise
    assert llm.wait_for_completion(use_tqdm=False) == []
    # generate() while requests are enqueued: both finish, each call gets its own outputs.
    extra = llm.enqueue(TokensPrompt(prompt_token_ids=rl_prompts[0]), GREEDY)
    assert len(run(llm, rl_prompts[1:2])) == 1
    outs = llm.wait_for_completion(use_tqdm=False)
    assert [o.request_id for o in outs] == extra and outs[0].finished
    with pytest.raises(ValueError, match="sampling_params"):
        llm.enqueue([TokensPrompt(prompt_token_ids=[1])] * 2, [GREEDY])


def test_get_metrics(llm: LLM, rl_prompts: list[list[int]]) -> None:
    def snapshot() -> dict[str, object]:
        out: dict[str, object] = {}
        for m in llm.get_metrics():
            key = m.name + ("" if "finished_reason" not in m.labels else f"[{m.labels['finished_reason']}]")
            out[key] = m
        return out

    before = snapshot()
    sp = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True, detokenize=False)
    assert llm.reset_prefix_cache()
    run(llm, rl_prompts, sp)
    after = snapshot()
    for name, cls in [
        ("pagedllm:prompt_tokens", Counter),
        ("pagedllm:num_requests_running", Gauge),
        ("pagedllm:e2e_request_latency_seconds", Histogram),
    ]:
        assert isinstance(after[name], cls), name

    def delta(name: str) -> float:
        a, b = after[name], before.get(name)
        if isinstance(a, Histogram):
            return a.count - (b.count if b else 0)  # type: ignore[union-attr]
        return a.value - (b.value if b else 0)  # type: ignore[union-attr]

    assert delta("pagedllm:prompt_tokens") == sum(len(p) for p in rl_prompts)
    assert delta("pagedllm:generation_tokens") == 7 * len(rl_prompts)
    assert delta("pagedllm:request_success[length]") == len(rl_prompts)
    assert delta("pagedllm:e2e_request_latency_seconds") == len(rl_prompts)
    e2e = after["pagedllm:e2e_request_latency_seconds"]
    assert e2e.buckets["+Inf"] == e2e.count and e2e.sum > 0  # type: ignore[union-attr]
    assert after["pagedllm:num_requests_running"].value == 0  # type: ignore[union-attr]


def test_profile_trace_is_json(llm: LLM, rl_prompts: list[list[int]]) -> None:
    llm.start_profile()
    with pytest.raises(ValueError, match="already running"):
        llm.start_profile()
    run(llm, rl_prompts[:2])
    (path,) = llm.stop_profile()
    with open(path) as f:
        trace = json.load(f)
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert any(n.startswith("aten::") for n in names), sorted(names)[:20]
    assert Path(path).parent == Path(llm.llm_engine.config.extra["profiler_config"]["torch_profiler_dir"])
    with pytest.raises(ValueError, match="no profile is running"):
        llm.stop_profile()


def test_profile_without_directory(tiny_ckpts: tuple[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGEDLLM_TORCH_PROFILER_DIR", raising=False)
    plain = LLM(tiny_ckpts[1], **ENGINE_KW)
    with pytest.raises(ValueError, match="torch_profiler_dir"):
        plain.start_profile()
    with pytest.raises(ValueError, match="profiler"):
        LLM(tiny_ckpts[1], profiler_config={"profiler": "nsys"}, **ENGINE_KW)
    with pytest.raises(ValueError, match="backend"):
        LLM(tiny_ckpts[1], weight_transfer_config={"backend": "carrier-pigeon"}, **ENGINE_KW)
