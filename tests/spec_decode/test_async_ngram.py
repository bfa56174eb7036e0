"""N-gram speculation with async scheduling (`spec_decode/async_ngram.py`): the device-side proposer equals the
host's, the device-side greedy verification equals the rejection sampler's greedy case, and the engine's greedy
outputs equal HF transformers' with steps launched ahead, under chunked prefill, preemption and requests that
force synchronous steps (logprobs, penalties) in the same batch."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams, TokensPrompt
from pagedllm.sample.rejection_sampler import greedy_verify, rejection_sample
from pagedllm.spec_decode.device_ngram import ngram_propose_device
from pagedllm.spec_decode.ngram import ngram_propose
from tests.hf_utils import compare_greedy, hf_greedy
from tests.utils_model import VOCAB, make_tiny_hf_model


def test_device_ngram_equals_host_ngram() -> None:
    rng = np.random.default_rng(0)
    checked = found = 0
    for _ in range(200):
        b, width = 5, 48
        k, n_min = int(rng.integers(1, 6)), int(rng.integers(1, 3))
        n_max = int(rng.integers(n_min, 5))
        hist = rng.integers(0, int(rng.integers(2, 6)), size=(b, width))
        lens = rng.integers(0, width, size=b)
        bound = min(width, int(lens.max()) + int(rng.integers(1, 3)))
        props, real = ngram_propose_device(torch.from_numpy(hist), torch.from_numpy(lens), n_min, n_max, k, bound)
        for i in range(b):
            ref = ngram_propose(hist[i, : lens[i]], n_min, n_max, k).tolist()
            assert props[i, : int(real[i])].tolist() == ref, (i, lens[i], n_min, n_max, k)
            checked += 1
            found += bool(ref)
    assert found > checked // 4  # the random contexts do exercise matches


def test_greedy_verify_equals_rejection_sampler_greedy_case() -> None:
    torch.manual_seed(0)
    num_draft = np.array([3, 0, 2, 4, 1])
    rows = int((num_draft + 1).sum())
    logits = torch.randn(rows, 11)
    argmax = logits.argmax(dim=1)
    starts = np.cumsum(num_draft + 1) - (num_draft + 1)
    drafts = []  # each request's proposals agree with the argmax for a while, then not
    for b, k in enumerate(num_draft.tolist()):
        for j in range(k):
            t = int(argmax[starts[b] + j])
            drafts.append(t if j < b % 3 + 1 else (t + 1) % 11)
    d = torch.tensor(drafts, dtype=torch.int64)
    got = greedy_verify(argmax, d, num_draft)
    ref = rejection_sample(argmax, logits, torch.ones(len(num_draft), dtype=torch.bool), d, num_draft)
    assert torch.equal(got.num_emitted, ref.num_emitted)
    assert torch.equal(got.token_ids, ref.token_ids)


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):  # noqa: ANN001, ANN201
    d = tmp_path_factory.mktemp("async_ngram_target")
    return str(d), make_tiny_hf_model("llama", d, seed=0)


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    motif = [rng.randrange(VOCAB) for _ in range(7)]
    return [motif * 4 + [rng.randrange(VOCAB) for _ in range(n)] for n in (0, 3, 11, 26)] + [
        [rng.randrange(VOCAB) for _ in range(n)] for n in (5, 30)
    ]


def test_async_ngram_greedy_equals_hf(tiny_target) -> None:  # noqa: ANN001
    torch.set_num_threads(2)
    path, hf = tiny_target
    prompts = _prompts()
    refs = [hf_greedy(hf, p, 40) for p in prompts]
    llm = LLM(
        path, dtype="float32", skip_tokenizer_init=True, max_model_len=128, num_gpu_blocks_override=14,
        schedule_conservativeness=0.0,  # (admit all: the small cache preempts)
        max_num_batched_tokens=16, disable_log_stats=True, async_scheduling=True,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
                            "prompt_lookup_min": 1},
    )  # fmt: skip
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    for p, o, r in zip(prompts, outs, refs):
        compare_greedy(hf, p, list(o.outputs[0].token_ids), r, torch.float32)
    core = llm.llm_engine.engine_core.engine_core
    tot = core.scheduler.spec.totals
    assert core.num_steps_ahead > 0, "steps were meant to be launched ahead"
    assert core.scheduler.num_preemptions > 0, "the small KV cache was meant to force preemption"
    assert tot.num_accepted_tokens > 0 and tot.num_draft_tokens >= tot.num_accepted_tokens, tot


def test_async_ngram_with_requests_that_need_sync_steps(tiny_target) -> None:  # noqa: ANN001
    """Logprobs and penalty requests make steps synchronous while they run (their placeholder proposals are
    read back from the device); the greedy ones still equal the engine without speculation, logprobs too;
    a request reaching max_model_len stops there."""
    torch.set_num_threads(2)
    path, _ = tiny_target
    prompts = [TokensPrompt(prompt_token_ids=p) for p in _prompts()]
    g = {"temperature": 0.0, "ignore_eos": True, "detokenize": False}
    sps = [
        SamplingParams(max_tokens=30, **g),
        SamplingParams(max_tokens=30, logprobs=2, **g),
        SamplingParams(max_tokens=17, **g),
        SamplingParams(max_tokens=30, repetition_penalty=1.3, **g),
        SamplingParams(max_tokens=30, temperature=0.9, seed=3, ignore_eos=True, detokenize=False),
        SamplingParams(max_tokens=200, **g),
    ]
    common = {"dtype": "float32", "skip_tokenizer_init": True, "max_model_len": 128, "disable_log_stats": True}
    common["max_num_batched_tokens"] = 32
    ref = LLM(path, **common).generate(prompts, sps, use_tqdm=False)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    llm = LLM(path, async_scheduling=True, speculative_config=spec, **common)
    outs = llm.generate(prompts, sps, use_tqdm=False)
    assert llm.llm_engine.engine_core.engine_core.num_steps_ahead > 0
    for i in (0, 1, 2, 3, 5):
        assert outs[i].outputs[0].token_ids == ref[i].outputs[0].token_ids, i
    assert len(outs[4].outputs[0].token_ids) == 30
    assert len(outs[5].outputs[0].token_ids) == 128 - len(prompts[5].get("prompt_token_ids", []))
    for a, b in zip(outs[1].outputs[0].logprobs, ref[1].outputs[0].logprobs):
        assert a.keys() == b.keys()
        for t in a:
            assert abs(a[t].logprob - b[t].logprob) < 1e-3


def test_graph_input_fixup_matches_the_host_layout() -> None:
    """`fixup_graph_inputs` (run on the device before a verification graph's replay) writes what the host would
    lay out if it knew the requests' lengths: positions from each request's last token on, its last token and
    proposals as ids, seq_len counting all q rows, slots from the block table; -1 past a request's proposals
    and past max_model_len."""
    from types import SimpleNamespace

    from pagedllm.spec_decode.async_ngram import DeviceHistory, fixup_graph_inputs
    from pagedllm.worker.input_batch import CachedRequestState

    k, bs, max_len = 3, 4, 24
    hist = DeviceHistory(4, max_len, k, 1, 2, torch.device("cpu"))
    lens = [5, 22, 9]
    for i, n in enumerate(lens):
        toks = [(7 * i + j) % 13 for j in range(n)]
        hist.add(CachedRequestState(f"r{i}", toks[:3], toks[3:], SamplingParams(), None, [[]], 0))
        hist.drafts[hist.slot_of[f"r{i}"]] = torch.tensor([100 + 10 * i + j for j in range(k)])
    n, q = 3, k + 1
    tables = [torch.arange(n * (max_len // bs), dtype=torch.int32).view(n, -1) * 3 + 1]
    g = SimpleNamespace(
        q=q, positions=torch.zeros(n * q, dtype=torch.long), input_ids=torch.zeros(n * q, dtype=torch.long),
        seq_lens=torch.zeros(n, dtype=torch.int32), slots=[torch.zeros(n * q, dtype=torch.long)], block_tables=tables,
    )  # fmt: skip
    slots = torch.from_numpy(hist.slots(["r0", "r1", "r2"]))
    num_drafts = torch.tensor([3, 3, 1])
    fixup_graph_inputs(g, hist, slots, num_drafts, [bs], max_len)
    for i, n_tok in enumerate(lens):
        toks = [(7 * i + j) % 13 for j in range(n_tok)]
        pos = [n_tok - 1 + j for j in range(q)]
        assert g.positions[i * q : (i + 1) * q].tolist() == pos
        assert g.input_ids[i * q : (i + 1) * q].tolist() == [toks[-1]] + [100 + 10 * i + j for j in range(k)]
        assert int(g.seq_lens[i]) == n_tok - 1 + q
        want = [
            int(tables[0][i, p // bs]) * bs + p % bs if j <= int(num_drafts[i]) and p < max_len else -1
            for j, p in enumerate(pos)
        ]
        assert g.slots[0][i * q : (i + 1) * q].tolist() == want
    assert g.slots[0][2 * q - 1] == -1  # r1's last row is at position max_model_len: nothing written
