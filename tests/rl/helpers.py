"""Small helpers shared by the engine-control tests."""

from __future__ import annotations

from typing import Any

from pagedllm import LLM, SamplingParams
from pagedllm.inputs import TokensPrompt

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, detokenize=False, logprobs=2)


def run(llm: LLM, prompts: list[list[int]], sp: SamplingParams = GREEDY) -> list[tuple[list[int], list[Any]]]:
    """(token ids, per-step {token id: logprob}) of each prompt."""
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    return [_key(o) for o in outs]


def _key(out: Any) -> tuple[list[int], list[Any]]:
    c = out.outputs[0]
    lps = [{t: lp.logprob for t, lp in step.items()} for step in (c.logprobs or [])]
    return list(c.token_ids), lps


def keys(outs: list[Any]) -> list[tuple[list[int], list[Any]]]:
    return [_key(o) for o in outs]


def assert_same(a: list[Any], b: list[Any]) -> None:
    """Bitwise: the same engine (or an identical one) on the same weights must give the same tokens and
    logprobs."""
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert x[0] == y[0], f"prompt {i}: tokens differ\n{x[0]}\n{y[0]}"
        assert x[1] == y[1], f"prompt {i}: logprobs differ"
