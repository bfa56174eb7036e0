"""Acceptance 2: logprobs (sampled + top-k, ranks) and prompt logprobs from `LLM` on the real SmolLM2
(float32, CPU) equal HF transformers' teacher-forced log-softmax on the same token ids, compared by
token id within 1e-3; also across chunked prefill, for the whole vocabulary, and their validation."""

from __future__ import annotations

import pytest
import torch

from pagedllm import Logprob, SamplingParams, TokensPrompt
from tests.hf_utils import hf_logprobs

TOL = 1e-3


def check_position(d: dict[int, Logprob], ref: torch.Tensor, k: int, actual: int, extra: list[int] = ()) -> None:  # noqa: B006
    """One position: every reported id's logprob matches HF; the rank <= k entries are HF's top k
    (up to near ties); the actual token is there with HF's rank (up to near ties)."""
    assert actual in d, (actual, list(d))
    for t, lp in d.items():
        assert abs(lp.logprob - float(ref[t])) < TOL, (t, lp.logprob, float(ref[t]))
    top = [t for t, lp in d.items() if lp.rank is not None and lp.rank <= k]
    assert len(top) == min(k, ref.numel())
    if k:
        kth = float(ref.topk(k).values[-1])
        assert all(float(ref[t]) >= kth - TOL for t in top)
    r = d[actual].rank
    lo = int((ref > ref[actual] + TOL).sum()) + 1
    hi = int((ref >= ref[actual] - TOL).sum())
    assert r is not None and lo <= r <= hi, (r, lo, hi)
    for t in extra:
        assert t in d


def test_sample_and_prompt_logprobs_match_hf(
    smollm2_llm, smollm2_hf_model, smollm2_prompt_ids, smollm2_tokenizer
) -> None:  # noqa: ANN001
    prompts = [smollm2_prompt_ids[i] for i in (1, 7, -1)]
    params = [
        SamplingParams(temperature=0.8, seed=11, max_tokens=8, logprobs=5, prompt_logprobs=5, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=8, logprobs=2, prompt_logprobs=0, ignore_eos=True),
        SamplingParams(
            temperature=1.0,
            top_k=20,
            seed=3,
            max_tokens=8,
            logprobs=1,
            prompt_logprobs=1,
            logprob_token_ids=[28, 1000],
            ignore_eos=True,
        ),
    ]
    outs = smollm2_llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    for p, sp, out in zip(prompts, params, outs):
        comp = out.outputs[0]
        toks = list(comp.token_ids)
        ref = hf_logprobs(smollm2_hf_model, p + toks)
        assert comp.logprobs is not None and len(comp.logprobs) == len(toks) == 8
        extra = list(sp.logprob_token_ids or [])
        for j, (tok, d) in enumerate(zip(toks, comp.logprobs)):
            check_position(d, ref[len(p) - 1 + j], sp.logprobs, tok, extra)
        cum = sum(float(ref[len(p) - 1 + j, t]) for j, t in enumerate(toks))
        assert comp.cumulative_logprob == pytest.approx(cum, abs=TOL * len(toks))
        d0 = comp.logprobs[0]
        assert all(lp.decoded_token == smollm2_tokenizer.decode([t]) for t, lp in d0.items())
        plp = out.prompt_logprobs
        assert plp is not None and len(plp) == len(p) and plp[0] is None
        for i in range(1, len(p)):
            check_position(plp[i], ref[i - 1], sp.prompt_logprobs, p[i], extra)
    # Requests without logprobs carry none.
    plain = smollm2_llm.generate(
        [TokensPrompt(prompt_token_ids=prompts[0])], SamplingParams(max_tokens=2), use_tqdm=False
    )[0]
    assert plain.outputs[0].logprobs is None and plain.outputs[0].cumulative_logprob is None
    assert plain.prompt_logprobs is None


def test_prompt_logprobs_skip_prefix_cache(smollm2_llm, smollm2_prompt_ids) -> None:  # noqa: ANN001
    p = smollm2_prompt_ids[-1]  # the chat prompt, > 2 blocks
    assert len(p) > 32
    sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2)
    first = smollm2_llm.generate([TokensPrompt(prompt_token_ids=p)], sp, use_tqdm=False)[0]
    again = smollm2_llm.generate([TokensPrompt(prompt_token_ids=p)], sp, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0
    assert len(again.prompt_logprobs) == len(p)
    for a, b in zip(first.prompt_logprobs[1:], again.prompt_logprobs[1:]):
        assert a.keys() == b.keys()
    # Without prompt logprobs the same prompt hits the cache.
    hit = smollm2_llm.generate([TokensPrompt(prompt_token_ids=p)], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert hit.num_cached_tokens > 0


def test_chunked_prefill_and_full_vocab(smollm2_llm_chunked, smollm2_hf_model, smollm2_prompt_ids) -> None:  # noqa: ANN001
    p = smollm2_prompt_ids[-1] + smollm2_prompt_ids[9]  # ~60 tokens: 4 chunks of 16
    assert len(p) > 48
    sp = SamplingParams(temperature=0.0, max_tokens=2, logprobs=-1, prompt_logprobs=3, ignore_eos=True)
    out = smollm2_llm_chunked.generate([TokensPrompt(prompt_token_ids=p)], sp, use_tqdm=False)[0]
    toks = list(out.outputs[0].token_ids)
    ref = hf_logprobs(smollm2_hf_model, p + toks)
    vocab = ref.shape[1]
    for i in range(1, len(p)):
        check_position(out.prompt_logprobs[i], ref[i - 1], 3, p[i])
    for j, d in enumerate(out.outputs[0].logprobs):
        assert len(d) == vocab
        values = torch.tensor([lp.logprob for lp in d.values()], dtype=torch.float64)
        assert abs(float(values.logsumexp(0))) < 1e-4
        check_position(d, ref[len(p) - 1 + j], vocab, toks[j])


def test_logprobs_validation(smollm2_llm) -> None:  # noqa: ANN001
    vocab = smollm2_llm.llm_engine.model_config.vocab_size
    bad = [
        (dict(logprobs=21), "logprobs"),
        (dict(logprobs=-1), "logprobs"),
        (dict(prompt_logprobs=25), "prompt_logprobs"),
        (dict(logprobs=-2), "logprobs"),
        (dict(logit_bias={vocab: 1.0}), "logit_bias"),
        (dict(allowed_token_ids=[vocab + 5]), "allowed_token_ids"),
        (dict(logprob_token_ids=[vocab]), "logprob_token_ids"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-3.0), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(allowed_token_ids=[]), "allowed_token_ids"),
    ]
    for kw, field in bad:
        with pytest.raises(ValueError, match=field):
            smollm2_llm.generate(["hi"], SamplingParams(**kw), use_tqdm=False)
    from pagedllm import EngineArgs

    with pytest.raises(ValueError, match="logprobs_mode"):
        EngineArgs(logprobs_mode="nope").create_engine_config()


def test_logprobs_with_n(smollm2_llm, smollm2_prompt_ids) -> None:  # noqa: ANN001
    sp = SamplingParams(n=3, temperature=1.0, seed=0, max_tokens=4, logprobs=1, ignore_eos=True)
    out = smollm2_llm.generate([TokensPrompt(prompt_token_ids=smollm2_prompt_ids[0])], sp, use_tqdm=False)[0]
    assert len(out.outputs) == 3
    for c in out.outputs:
        assert len(c.logprobs) == len(c.token_ids) == 4
        assert c.cumulative_logprob == pytest.approx(sum(d[t].logprob for d, t in zip(c.logprobs, c.token_ids)))
