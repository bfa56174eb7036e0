"""The engine with the grammar server process (`structured_output/remote.py`), on a device: every structured
output's tokens are accepted by a matcher of this process (no token the grammar forbids, as a stale or missing
mask would let through), and async scheduling gives the synchronous engine's greedy tokens. Shared by the CPU test
(`test_grammar_process.py`) and the GPU one (`tests/gpu/test_structured_output_gpu.py`)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.structured_output.cases import REGEXES, SCHEMAS


def run_engine_case(
    monkeypatch: pytest.MonkeyPatch, device: str, tokenizer: str, model: str = "benchmarks/workloads/smollm2-135m"
) -> dict[bool, Any]:
    import xgrammar as xgr

    from pagedllm import LLM, SamplingParams, StructuredOutputsParams, TokensPrompt
    from pagedllm.benchmarks.workloads import TINY_OVERRIDES
    from pagedllm.structured_output.backend import XgrammarBackend
    from pagedllm.structured_output.config import StructuredOutputsConfig
    from pagedllm.structured_output.remote import ProcessGrammarManager
    from pagedllm.transformers_utils.tokenizer import get_tokenizer

    monkeypatch.setenv("PAGEDLLM_GRAMMAR_PROCESS", "1")
    params = [StructuredOutputsParams(json=s) for s in SCHEMAS.values()]
    params += [StructuredOutputsParams(regex=r) for r in REGEXES.values()]
    params += [StructuredOutputsParams(choice=["alpha", "beta", "gamma delta"])]
    n_plain = 3
    sps = [SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=p) for p in params]
    sps += [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)] * n_plain
    prompts = [TokensPrompt(prompt_token_ids=[100 + i, 200 + 3 * i, 300 + 7 * i]) for i in range(len(sps))]
    outs = {}
    for async_on in (True, False):
        llm = LLM(
            model,
            tokenizer=tokenizer,
            load_format="dummy",
            dtype="float32",
            device=device,
            hf_overrides=TINY_OVERRIDES,
            max_model_len=256,
            kv_cache_memory_bytes=64 << 20,
            async_scheduling=async_on,
        )
        core = llm.llm_engine.engine_core.engine_core
        outs[async_on] = llm.generate(prompts, sps, use_tqdm=False)
        assert isinstance(core.scheduler.structured, ProcessGrammarManager)
        del llm, core
    tok = get_tokenizer(tokenizer)
    backend = XgrammarBackend(tok, len(tok), [tok.eos_token_id], StructuredOutputsConfig())
    for out, p in zip(outs[True][: len(params)], params):
        ids = list(out.outputs[0].token_ids)
        assert out.outputs[0].finish_reason in ("stop", "length"), out.outputs[0]
        m = backend.matcher(backend.compile(p))
        for t in ids:
            assert not m.is_terminated()
            assert m.accept_token(t), (p, ids)
        if out.outputs[0].finish_reason == "stop" and not m.is_terminated():  # the stop token not in the output
            assert m.accept_token(tok.eos_token_id) and m.is_terminated()
    del xgr
    assert [o.outputs[0].token_ids for o in outs[True]] == [o.outputs[0].token_ids for o in outs[False]]
    assert all(len(o.outputs[0].token_ids) == 40 for o in outs[True][-n_plain:])
    return outs
