"""Acceptance 1 (CPU): a tiny random Llama with 3 random PEFT adapters; greedy outputs equal HF `PeftModel`'s
per adapter (float32 comparison policy), with the three adapters and the base model mixed in one batch; the
max_loras limit and slot swapping (max_loras=2 < 3 adapters); bad adapters refused with clear errors."""

from __future__ import annotations

import json
import os
import random
import shutil

import pytest
import torch

from pagedllm import LLM, LoRARequest, SamplingParams, TokensPrompt
from tests.hf_utils import compare_greedy, hf_greedy
from tests.lora.lora_utils import make_peft_adapter
from tests.utils_model import VOCAB, make_tiny_hf_model

pytest.importorskip("peft")

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):  # noqa: ANN201
    """(model dir, adapter dirs, prompts, per-adapter references [None = base] per prompt)."""
    from peft import PeftModel

    torch.set_num_threads(2)
    root = tmp_path_factory.mktemp("lora_tiny")
    base_dir = str(root / "base")
    hf = make_tiny_hf_model("llama", base_dir)
    rng = random.Random(0)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (5, 11, 19, 8)]
    adapters, refs = [], {None: [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]}
    for i, kw in enumerate([{}, {"use_rslora": True}, {"r": 4, "alpha": 8}]):
        path = str(root / f"adapter{i}")
        make_peft_adapter(make_tiny_hf_model("llama", str(root / "scratch")), path, seed=10 + i, **kw)
        pm = PeftModel.from_pretrained(make_tiny_hf_model("llama", str(root / "scratch")), path).eval()
        refs[i] = [hf_greedy(pm, p, MAX_TOKENS) for p in prompts]
        refs[f"model{i}"] = pm
        adapters.append(path)
    refs["base_model"] = hf
    # The adapters do change the outputs (else the test would prove nothing).
    assert all(refs[i] != refs[None] for i in range(3))
    return base_dir, adapters, prompts, refs


def _llm(base_dir: str, **kw) -> LLM:  # noqa: ANN003
    return LLM(
        base_dir,
        dtype="float32",
        skip_tokenizer_init=True,
        max_model_len=128,
        kv_cache_memory_bytes=8 << 20,
        max_num_batched_tokens=64,
        enable_lora=True,
        max_lora_rank=8,
        **kw,
    )


@pytest.fixture(scope="module")
def llm(tiny) -> LLM:  # noqa: ANN001
    return _llm(tiny[0], max_loras=4, max_cpu_loras=4)


def _check(tiny, outs, which: list[int | None]) -> None:  # noqa: ANN001
    _, _, prompts, refs = tiny
    for k, (o, a) in enumerate(zip(outs, which)):
        p = prompts[k % len(prompts)]
        model = refs["base_model"] if a is None else refs[f"model{a}"]
        compare_greedy(model, p, list(o.outputs[0].token_ids), refs[a][k % len(prompts)], torch.float32)


SP = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False)


def test_each_adapter_matches_peft(tiny, llm) -> None:  # noqa: ANN001
    base_dir, adapters, prompts, refs = tiny
    tp = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    for i, path in enumerate(adapters):
        outs = llm.generate(tp, SP, use_tqdm=False, lora_request=LoRARequest(f"a{i}", i + 1, path))
        _check(tiny, outs, [i] * len(prompts))


def test_mixed_batch_matches_peft(tiny, llm) -> None:  # noqa: ANN001
    """Three adapters and the base model in one batch (16 requests, all scheduled together)."""
    base_dir, adapters, prompts, refs = tiny
    which: list[int | None] = [None, 0, 1, 2] * 4
    which = which[1:] + which[:1]
    tp = [TokensPrompt(prompt_token_ids=prompts[k % 4]) for k in range(16)]
    loras = [None if a is None else LoRARequest(f"a{a}", a + 1, adapters[a]) for a in which]
    outs = llm.generate(tp, SP, use_tqdm=False, lora_request=loras)
    _check(tiny, outs, which)
    # Prefix caching keys blocks by adapter: a second identical run (cache hits) gives the same tokens.
    again = llm.generate(tp, SP, use_tqdm=False, lora_request=loras)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]


def test_max_loras_limits_and_swaps_slots(tiny) -> None:  # noqa: ANN001
    """max_loras=2 with 3 adapters: the scheduler never runs more than 2 distinct adapters in a step, the
    runner swaps slots (least recently used), and every output still matches."""
    base_dir, adapters, prompts, refs = tiny
    llm2 = _llm(base_dir, max_loras=2, max_cpu_loras=2)
    core = llm2.llm_engine.engine_core.engine_core
    seen: list[int] = []
    orig = core.scheduler.schedule

    def schedule():  # noqa: ANN202
        so = orig()
        ids = {r.lora_id for r in core.scheduler.running if r.lora_id is not None}
        seen.append(len(ids))
        return so

    core.scheduler.schedule = schedule
    which: list[int | None] = [0, 1, 2, None] * 2
    tp = [TokensPrompt(prompt_token_ids=prompts[k % 4]) for k in range(8)]
    loras = [None if a is None else LoRARequest(f"a{a}", a + 1, adapters[a]) for a in which]
    outs = llm2.generate(tp, SP, use_tqdm=False, lora_request=loras)
    _check(tiny, outs, which)
    assert max(seen) == 2
    # max_cpu_loras: exceeded only while three adapters have unfinished requests, dropped back after.
    llm2.generate(tp[:1], SP, use_tqdm=False, lora_request=loras[0])
    assert len(core.lora.registered) == 2


def _bad(tmp_path, src: str, name: str, edit) -> str:  # noqa: ANN001
    dst = str(tmp_path / name)
    shutil.copytree(src, dst)
    edit(dst)
    return dst


def _edit_config(**kv):  # noqa: ANN003, ANN202
    def edit(d: str) -> None:
        p = os.path.join(d, "adapter_config.json")
        with open(p) as f:
            cfg = json.load(f)
        cfg.update(kv)
        with open(p, "w") as f:
            json.dump(cfg, f)

    return edit


def test_bad_adapters_are_refused_and_engine_keeps_serving(tiny, llm, tmp_path) -> None:  # noqa: ANN001
    base_dir, adapters, prompts, refs = tiny
    tp = [TokensPrompt(prompt_token_ids=prompts[0])]
    cases = {
        "missing": (str(tmp_path / "nowhere"), "no adapter directory"),
        "modules_to_save": (
            _bad(tmp_path, adapters[0], "mts", _edit_config(modules_to_save=["lm_head"])),
            "modules_to_save",
        ),
        "dora": (_bad(tmp_path, adapters[0], "dora", _edit_config(use_dora=True)), "DoRA"),
    }
    # Rank 8 > max_lora_rank 4 of a second engine is checked below; shapes of another base model here:
    other = str(tmp_path / "other_base")
    from tests.utils_model import tiny_hf_config

    cfg = tiny_hf_config("llama")
    cfg.intermediate_size = 96
    make_peft_adapter(make_tiny_hf_model("llama", other, config=cfg), str(tmp_path / "other"), seed=3)
    cases["mismatch"] = (str(tmp_path / "other"), "another base model")
    for i, (path, msg) in enumerate(cases.values()):
        with pytest.raises(ValueError, match=msg):
            llm.generate(tp, SP, use_tqdm=False, lora_request=LoRARequest("bad", 50 + i, path))
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("bad", 0, adapters[0])
    # Still serving, adapters and base alike.
    tp2 = [TokensPrompt(prompt_token_ids=p) for p in prompts[:2]]
    outs = llm.generate(tp2, SP, use_tqdm=False, lora_request=[LoRARequest("a0", 1, adapters[0]), None])
    _check(tiny, outs, [0, None])


def test_rank_over_max_and_lora_disabled(tiny) -> None:  # noqa: ANN001
    base_dir, adapters, prompts, refs = tiny
    tp = [TokensPrompt(prompt_token_ids=prompts[0])]
    small = LLM(
        base_dir,
        dtype="float32",
        skip_tokenizer_init=True,
        max_model_len=64,
        kv_cache_memory_bytes=4 << 20,
        enable_lora=True,
        max_lora_rank=4,
    )
    with pytest.raises(ValueError, match="exceeds max_lora_rank=4"):
        small.generate(tp, SP, use_tqdm=False, lora_request=LoRARequest("a0", 1, adapters[0]))
    small.generate(tp, SP, use_tqdm=False, lora_request=LoRARequest("a2", 3, adapters[2]))  # rank 4 fits
    del small
    plain = LLM(base_dir, dtype="float32", skip_tokenizer_init=True, max_model_len=64, kv_cache_memory_bytes=4 << 20)
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        plain.generate(tp, SP, use_tqdm=False, lora_request=LoRARequest("a0", 1, adapters[0]))
    assert plain.llm_engine.engine_core.engine_core.executor.worker.model_runner.lora is None


def test_adapter_load_does_not_block_steps(tiny, llm, monkeypatch) -> None:  # noqa: ANN001
    """While an adapter's files are read (slowed to 1 s here), the step loop keeps serving base requests;
    the LoRA request enters the scheduler once its adapter is in, and finishes correctly."""
    import threading

    import pagedllm.lora.staging as staging

    base_dir, adapters, prompts, refs = tiny
    gate = threading.Event()
    real = staging.load_adapter

    def slow_load(*a, **k):  # noqa: ANN002, ANN003, ANN202
        gate.wait(5)
        return real(*a, **k)

    monkeypatch.setattr(staging, "load_adapter", slow_load)
    engine = llm.llm_engine
    engine.add_request(
        "slow-lora", TokensPrompt(prompt_token_ids=prompts[1]), SP, lora_request=LoRARequest("n", 9, adapters[1])
    )
    engine.add_request("base", TokensPrompt(prompt_token_ids=prompts[0]), SP)
    done: dict[str, list[int]] = {}
    steps_before = 0
    while "base" not in done:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        steps_before += 1
    assert "slow-lora" not in done and steps_before >= MAX_TOKENS  # the base request ran to the end meanwhile
    gate.set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    assert done["base"] == refs[None][0]
    compare_greedy(refs["model1"], prompts[1], done["slow-lora"], refs[1][1], torch.float32)
