"""Acceptance 1 (exact tensor tests): penalties, logit_bias, allowed_token_ids, bad_words and min_tokens
change the logits exactly as the reference formulas say, per row, in one mixed batch; plus the
persistent (incremental) penalty counts, custom logits processors and end-to-end checks on SmolLM2."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams, TokensPrompt
from pagedllm.sample.logits_processor import LogitsProcessor
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.penalties import TokenCountSlots
from pagedllm.sample.sampler import Sampler
from pagedllm.worker.sampling_batch import build_sampling_metadata

V = 32
INF = float("inf")


def processed(params: list[SamplingParams], logits: torch.Tensor, prompts=None, outputs=None) -> torch.Tensor:  # noqa: ANN001
    md = build_sampling_metadata(params, V, prompts, outputs)
    return Sampler().apply_logits_processors(logits.clone(), md)


def ref_penalties(row: np.ndarray, prompt: list[int], output: list[int], sp: SamplingParams) -> np.ndarray:
    """vLLM/HF formulas, element by element in float64."""
    out = row.astype(np.float64).copy()
    for t in range(V):
        if t in prompt or t in output:
            r = sp.repetition_penalty
            out[t] = out[t] / r if out[t] > 0 else out[t] * r
        c = output.count(t)
        out[t] -= sp.frequency_penalty * c
        out[t] -= sp.presence_penalty * (1.0 if c > 0 else 0.0)
    return out


def test_penalties_exact() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, V, generator=g) * 3
    params = [
        SamplingParams(repetition_penalty=1.7),
        SamplingParams(frequency_penalty=0.6, presence_penalty=-0.4, temperature=0.0),
        SamplingParams(repetition_penalty=0.8, frequency_penalty=-1.1, presence_penalty=1.5),
        SamplingParams(),  # unpenalized row in the same batch: untouched
    ]
    prompts = [[1, 2, 3, 3], [4, 5], [6, 7, 30], [1, 2]]
    outputs = [[3, 9, 9], [5, 5, 5, 8, 31], [7, 7, 0], [1, 9]]
    got = processed(params, logits, prompts, outputs)
    for i, sp in enumerate(params):
        ref = ref_penalties(logits[i].numpy(), prompts[i], outputs[i], sp)
        np.testing.assert_allclose(got[i].numpy(), ref, rtol=1e-6, atol=1e-6)
    # The prompt counts for repetition only, not for frequency/presence.
    assert got[1, 4] == logits[1, 4]


def test_logit_bias_exact_and_clamped() -> None:
    logits = torch.linspace(-3, 3, V).repeat(2, 1)
    params = [SamplingParams(logit_bias={0: 2.5, 7: -1.25, 31: 500.0}), SamplingParams()]
    got = processed(params, logits)
    ref = logits.clone()
    ref[0, 0] += 2.5
    ref[0, 7] -= 1.25
    ref[0, 31] += 100.0  # clamped to [-100, 100], as vLLM
    assert torch.equal(got, ref)


def test_allowed_token_ids_exact() -> None:
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(allowed_token_ids=[2, 5, 17]), SamplingParams(), SamplingParams(allowed_token_ids=[0])]
    got = processed(params, logits)
    for row, allowed in ((0, [2, 5, 17]), (2, [0])):
        mask = torch.ones(V, dtype=torch.bool)
        mask[allowed] = False
        assert torch.equal(got[row][~mask], logits[row][~mask])
        assert torch.isinf(got[row][mask]).all() and (got[row][mask] < 0).all()
    assert torch.equal(got[1], logits[1])


def test_bad_words_blocked_at_last_token() -> None:
    logits = torch.zeros(4, V)
    words = [[9], [4, 5, 6], [7, 8]]
    params = [SamplingParams(), SamplingParams(), SamplingParams(), SamplingParams()]
    for sp in params:
        sp.bad_words_token_ids = words
    outputs = [[], [1, 4, 5], [7], [4, 5, 1]]
    prompts = [[4, 5], [0], [0], [7]]  # prompt tokens never count (vLLM: generated tokens only)
    got = processed(params, logits, prompts, outputs)
    blocked = {0: {9}, 1: {9, 6}, 2: {9, 8}, 3: {9}}
    for row, ids in blocked.items():
        expect = torch.zeros(V)
        expect[list(ids)] = -INF
        assert torch.equal(got[row], expect), (row, got[row])


def test_bad_words_tokenized_like_vllm(smollm2_tokenizer) -> None:  # noqa: ANN001
    sp = SamplingParams(bad_words=["hello", " world wide"])
    sp.update_from_tokenizer(smollm2_tokenizer)
    enc = lambda s: smollm2_tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    assert enc("hello") in sp.bad_words_token_ids and enc(" hello") in sp.bad_words_token_ids
    assert enc("world wide") in sp.bad_words_token_ids


def test_min_tokens_masks_stop_tokens_until_reached() -> None:
    logits = torch.ones(3, V)
    sp = SamplingParams(min_tokens=3, all_stop_token_ids=[2, 11])
    got = processed([sp, sp, SamplingParams()], logits, outputs=[[5, 6], [5, 6, 7], []])
    expect = torch.ones(3, V)
    expect[0, [2, 11]] = -INF
    assert torch.equal(got, expect)


def test_everything_in_one_mixed_batch() -> None:
    """Greedy, sampled, penalized, biased, restricted and logprob rows in one call, each row exactly
    equal to its own single-row result."""
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(2)) * 2
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.3),
        SamplingParams(temperature=0.7, top_k=5, seed=3, logprobs=3),
        SamplingParams(temperature=0.0, logit_bias={3: 50.0}, logprobs=0),
        SamplingParams(temperature=1.0, allowed_token_ids=[1, 2, 3], frequency_penalty=0.5),
        SamplingParams(temperature=0.0, min_tokens=2, all_stop_token_ids=[int(logits[4].argmax())]),
        SamplingParams(temperature=0.9, top_p=0.9, min_p=0.05, presence_penalty=1.0),
    ]
    prompts = [[1, 2], [3], [4, 4], [5], [6], [7, 8]]
    outputs = [[int(logits[0].argmax())], [], [0], [2, 2], [], [int(logits[5].argmax())]]
    got = processed(params, logits, prompts, outputs)
    for i in range(6):
        alone = processed([params[i]], logits[i : i + 1], [prompts[i]], [outputs[i]])
        assert torch.equal(got[i], alone[0])
    gens = {1: torch.Generator().manual_seed(3)}
    md = build_sampling_metadata(params, V, prompts, outputs, generators=gens)
    out = Sampler()(logits.clone(), md)
    toks = out.sampled_token_ids
    assert toks[2] == 3 and toks[3] in (1, 2, 3)
    assert toks[4] != int(logits[4].argmax())  # stop token masked before min_tokens
    assert toks[0] == got[0].argmax()
    assert out.logprobs is not None and len(out.logprobs) == 2  # rows 1 and 2 asked for logprobs
    assert len(out.logprobs.token_ids[0]) == 4 and len(out.logprobs.token_ids[1]) == 1
    # Raw logprobs (default mode): from the unprocessed logits.
    raw = logits.log_softmax(-1)
    assert abs(out.logprobs.logprobs[1][0] - float(raw[2, 3])) < 1e-6


def test_logprobs_gather_ranks_and_full_vocab() -> None:
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(4))
    md = build_sampling_metadata(
        [
            SamplingParams(temperature=0.0, logprobs=-1),
            SamplingParams(temperature=0.0, logprobs=2, logprob_token_ids=[0, 31]),
        ],
        V,
    )
    out = Sampler()(logits.clone(), md)
    lp = logits.log_softmax(-1)
    assert out.logprobs is not None
    ids0 = out.logprobs.token_ids[0]
    assert len(ids0) == 1 + V and sorted(ids0[1:]) == list(range(V))
    assert out.logprobs.ranks[0][0] == 1
    ids1, lps1, ranks1 = out.logprobs.token_ids[1], out.logprobs.logprobs[1], out.logprobs.ranks[1]
    assert ids1[-2:] == [0, 31]
    for t, v, r in zip(ids1, lps1, ranks1):
        assert abs(v - float(lp[1, t])) < 1e-6
        assert r == int((lp[1] >= lp[1, t]).sum())


@pytest.mark.parametrize("mode", ["raw_logits", "processed_logprobs", "processed_logits"])
def test_logprobs_modes(mode: str) -> None:
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(5))
    sp = SamplingParams(temperature=0.5, top_k=3, logprobs=V, logit_bias={0: 1.0})
    md = build_sampling_metadata([sp], V)
    torch.manual_seed(0)
    out = Sampler(logprobs_mode=mode)(logits.clone(), md)
    assert out.logprobs is not None
    got = dict(zip(out.logprobs.token_ids[0], out.logprobs.logprobs[0]))
    biased = logits[0].clone()
    biased[0] += 1.0
    if mode == "raw_logits":
        ref = logits[0]
    else:
        scaled = biased / 0.5
        kth = scaled.topk(3).values[-1]
        ref = scaled.masked_fill(scaled < kth, -INF)
        if mode == "processed_logprobs":
            ref = ref.log_softmax(-1)
    for t, v in got.items():
        assert v == pytest.approx(float(ref[t]), abs=1e-5) or (v == float(ref[t]) == -INF)


def test_token_count_slots_incremental() -> None:
    slots = TokenCountSlots(V, max_slots=8, device=torch.device("cpu"))
    rng = np.random.default_rng(0)
    live: dict[int, list[int]] = {}
    for _ in range(6):
        out0 = list(rng.integers(0, V, 3))
        live[slots.acquire([1, 2], out0)] = out0
    slots.release(next(iter(live)))
    del live[next(iter(live))]
    live[slots.acquire([3], [])] = []
    for _ in range(20):
        ks = np.array(list(live))
        toks = rng.integers(0, V, len(ks))
        slots.add_tokens(ks, toks)
        for k, t in zip(ks, toks):
            live[int(k)].append(int(t))
    for k, toks in live.items():
        assert torch.equal(
            slots.output_counts[k], torch.bincount(torch.tensor(toks, dtype=torch.long), minlength=V).int()
        )


class Recorder(LogitsProcessor):
    """A custom batch-level processor with per-request state: bans one token per request."""

    def __init__(self) -> None:
        self.banned: dict[str, int] = {}
        self.boom: dict[str, int] = {}
        """Request -> raise once its output has this many tokens (a user processor failing on one request)."""
        self.steps: list[list[str]] = []
        self.removed: list[str] = []

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        if params.extra_args and not isinstance(params.extra_args.get("ban"), int):
            raise ValueError("extra_args.ban: must be a token id")

    def add_request(self, req_id, params, prompt_token_ids, output_token_ids) -> None:  # noqa: ANN001
        if params.extra_args:
            self.banned[req_id] = params.extra_args["ban"]
            if "boom" in params.extra_args:
                self.boom[req_id] = params.extra_args["boom"]

    def remove_request(self, req_id: str) -> None:
        self.removed.append(req_id)
        self.banned.pop(req_id, None)

    def apply(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        self.steps.append(list(metadata.req_ids))
        rows = [i for i, r in enumerate(metadata.req_ids) if r in self.banned]
        if rows:
            logits[torch.tensor(rows), 0] *= 2.0  # in place, before a failure below (not idempotent)
        for i, r in enumerate(metadata.req_ids):
            if r in self.boom and len(metadata.output_token_ids[i]) >= self.boom[r]:
                raise RuntimeError(f"boom on {r}")
        if rows:
            ids = [self.banned[metadata.req_ids[i]] for i in rows]
            logits[torch.tensor(rows), torch.tensor(ids)] = -INF
        return logits


@pytest.mark.slow  # CI time: run by hand (pytest -m slow)
def test_custom_processor_and_mixed_step_end_to_end(smollm2_path, smollm2_prompt_ids) -> None:  # noqa: ANN001
    rec = Recorder()
    llm = LLM(
        smollm2_path,
        dtype="float32",
        max_model_len=256,
        kv_cache_memory_bytes=32 << 20,
        logits_processors=[rec],
        gguf_dequantize=True,
    )
    prompt = smollm2_prompt_ids[1]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    base = llm.generate([TokensPrompt(prompt_token_ids=prompt)], greedy, use_tqdm=False)[0].outputs[0].token_ids
    banned = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, extra_args={"ban": base[0]})
    with pytest.raises(ValueError, match="extra_args.ban"):
        llm.generate(["x"], SamplingParams(extra_args={"ban": "no"}), use_tqdm=False)
    # One engine step serves a greedy, a sampled, a penalized, a logprobs and a custom-processor request.
    engine = llm.llm_engine
    mixed = {
        "g": greedy,
        "s": SamplingParams(temperature=0.9, top_p=0.9, seed=1, max_tokens=6, ignore_eos=True),
        "p": SamplingParams(
            temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.5, max_tokens=6, ignore_eos=True
        ),
        "l": SamplingParams(temperature=0.0, logprobs=3, max_tokens=6, ignore_eos=True),
        "b": banned,
        # A request the user's processor raises on at its third step: only it fails.
        "x": SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, extra_args={"ban": base[0], "boom": 2}),
    }
    for rid, sp in mixed.items():
        engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), sp)
    n_steps = 0
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out
        n_steps += 1
    assert n_steps == 6  # every request got a token in every step
    assert set(rec.steps[-1]) == set(mixed) - {"x"}
    assert results["g"].outputs[0].token_ids == base
    assert results["b"].outputs[0].token_ids[0] != base[0]
    failed = results["x"].outputs[0]
    assert failed.finish_reason == "error" and "boom on x" in str(failed.stop_reason)
    assert failed.token_ids == results["b"].outputs[0].token_ids[:2]  # its tokens before the failure
    assert not engine.has_unfinished_requests()
    assert len(results["l"].outputs[0].logprobs) == 6
    # Finished ids reach the worker with the next step: one more request delivers them.
    llm.generate([TokensPrompt(prompt_token_ids=prompt)], SamplingParams(max_tokens=1), use_tqdm=False)
    assert "b" in rec.removed and "b" not in rec.banned


def test_repetition_penalty_matches_hf(smollm2_llm, smollm2_hf_model, smollm2_prompt_ids) -> None:  # noqa: ANN001
    """Greedy with repetition_penalty (prompt + output counted) equals HF transformers' generate."""
    from transformers import GenerationConfig

    sp = SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=12, ignore_eos=True)
    prompts = smollm2_prompt_ids[:3]
    outs = smollm2_llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    model = smollm2_hf_model
    for p, o in zip(prompts, outs):
        ids = torch.tensor([p])
        gc = GenerationConfig(
            max_new_tokens=12,
            do_sample=False,
            repetition_penalty=1.3,
            eos_token_id=None,
            pad_token_id=0,
            bos_token_id=None,
        )
        saved = model.generation_config.eos_token_id
        model.generation_config.eos_token_id = None
        try:
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc)[0, len(p) :].tolist()
        finally:
            model.generation_config.eos_token_id = saved
        assert list(o.outputs[0].token_ids) == ref


def test_top_p_candidate_path_equals_full_sort() -> None:
    """The topk-candidate top-p (large vocabularies) keeps exactly the tokens the full sort keeps."""
    from pagedllm.sample.top_k_top_p import _sorted_top_k_top_p, _top_p_by_candidates

    g = torch.Generator().manual_seed(6)
    vocab = 40_000
    logits = torch.randn(8, vocab, generator=g) * 2
    logits[:4, :20] += 9.0  # peaked rows: decided among the first candidates
    # rows 4..7 are flat: the nucleus spans thousands of tokens (candidate growth / sort fallback)
    p = torch.tensor([0.9, 0.5, 0.99, 0.3, 0.9, 0.5, 0.95, 0.2])
    k = torch.tensor([0, 10, 0, 300, 0, 0, 1000, 0])
    got = _top_p_by_candidates(logits.clone(), k, p)
    ref = _sorted_top_k_top_p(logits.clone(), k, p)
    assert torch.equal(torch.isinf(got), torch.isinf(ref))
    assert torch.equal(got[~torch.isinf(got)], logits[~torch.isinf(got)])


def test_top_k_top_p_by_topk_equals_full_sort() -> None:
    """The CUDA path for rows with a small top-k and a top-p (one topk, no sort) keeps exactly what the
    full sort keeps, each row with its own k and p."""
    from pagedllm.sample.top_k_top_p import _sorted_top_k_top_p, _top_k_top_p_by_topk

    g = torch.Generator().manual_seed(9)
    for trial in range(6):
        logits = torch.randn(16, 5000, generator=g) * (1 + trial)
        if trial % 2:
            logits[:, :40] += 6.0
        k = torch.randint(1, 400, (16,), generator=g)
        p = torch.rand(16, generator=g) * 0.98 + 0.01
        got = _top_k_top_p_by_topk(logits.clone(), k, p, int(k.max()))
        ref = _sorted_top_k_top_p(logits.clone(), k, p)
        assert torch.equal(torch.isinf(got), torch.isinf(ref))


def test_failing_custom_processor_fails_only_its_rows() -> None:
    """The batch call raises after editing some rows in place: the processor is re-run row by row on the
    logits as they were, the failing row is reported, the others get exactly the processor's output."""
    rec = Recorder()
    params = [SamplingParams(temperature=0.0, extra_args={"ban": 3}), SamplingParams(temperature=0.0)]
    params.append(SamplingParams(temperature=0.0, extra_args={"ban": 5, "boom": 1}))
    md = build_sampling_metadata(params, V, [[1], [2], [3]], [[7], [8], [9]])
    md.req_ids = ["a", "b", "c"]
    for rid, sp in zip(md.req_ids, params):
        rec.add_request(rid, sp, [], [])
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0))
    failed: dict[int, str] = {}
    got = Sampler([rec]).apply_logits_processors(logits.clone(), md, failed)
    assert list(failed) == [2] and "boom on c" in failed[2]
    want = logits.clone()
    want[0, 0] *= 2.0
    want[0, 3] = -INF
    torch.testing.assert_close(got[:2], want[:2], rtol=0, atol=0)
    out = Sampler([rec])(logits.clone(), md)
    assert out.failed_rows is not None and list(out.failed_rows) == [2]
    with pytest.raises(RuntimeError, match="boom"):  # without a place to report, the error propagates
        Sampler([rec]).apply_logits_processors(logits.clone(), md)
