"""`speculative_config` parsing (vLLM's names, aliases, errors naming the field) and the n-gram proposer
against a brute-force reference."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.spec_decode.ngram import ngram_propose


def test_config_dict_json_and_aliases() -> None:
    d = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    a = SpeculativeConfig.from_args(d)
    b = SpeculativeConfig.from_args(
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
    )
    c = SpeculativeConfig.from_args(None, spec_method="ngram", spec_tokens=4)
    assert a == b
    assert a is not None and (a.prompt_lookup_min, a.prompt_lookup_max) == (2, 4)
    assert c is not None and (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)  # vLLM's defaults
    d2 = SpeculativeConfig.from_args({"model": "some/dir", "num_speculative_tokens": 3})
    assert d2 is not None and d2.method == "draft_model"
    assert SpeculativeConfig.from_args(None) is None
    assert SpeculativeConfig.from_args({"method": "[ngram]", "num_speculative_tokens": 1}).method == "ngram"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"speculative_config": {"method": "medusa", "num_speculative_tokens": 2}}, "speculative_config.method"),
        ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 0}}, "num_speculative_tokens"),
        ({"speculative_config": {"method": "ngram"}}, "num_speculative_tokens"),
        ({"speculative_config": {"method": "draft_model", "num_speculative_tokens": 2}}, "speculative_config.model"),
        ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2, "bogus": 1}}, "bogus"),
        (
            {
                "speculative_config": {
                    "method": "ngram",
                    "num_speculative_tokens": 2,
                    "prompt_lookup_min": 5,
                    "prompt_lookup_max": 2,
                }
            },
            "prompt_lookup_min",
        ),
        ({"speculative_config": "{not json"}, "speculative_config"),
        ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}, "spec_tokens": 3}, "spec_tokens"),
        ({"spec_method": "ngram", "spec_tokens": -1}, "num_speculative_tokens"),
        (
            {"spec_method": "draft_model", "spec_model": "x", "spec_tokens": 2, "async_scheduling": True},
            "async_scheduling",
        ),
    ],
)
def test_bad_config_errors_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        EngineArgs(**kwargs).create_engine_config()


def test_cli_flag_parses_json() -> None:
    import argparse

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    ea = EngineArgs.from_cli_args(args)
    assert ea.speculative_config == {"method": "ngram", "num_speculative_tokens": 3}
    args = parser.parse_args(["--spec-method", "ngram", "--spec-tokens", "2"])
    assert (EngineArgs.from_cli_args(args).spec_method, EngineArgs.from_cli_args(args).spec_tokens) == ("ngram", 2)


def _brute(ctx: list[int], n_min: int, n_max: int, k: int) -> list[int]:
    """The longest suffix (n_max down to n_min) with an earlier occurrence; its most recent one."""
    L = len(ctx)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        suffix = ctx[L - n :]
        for start in range(L - n - 1, -1, -1):
            if ctx[start : start + n] == suffix:
                return ctx[start + n : start + n + k]
    return []


def test_ngram_matches_brute_force() -> None:
    rng = random.Random(0)
    for trial in range(400):
        vocab = rng.choice([2, 3, 5, 20])
        ctx = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
        n_min = rng.randint(1, 3)
        n_max = rng.randint(n_min, 5)
        k = rng.randint(1, 5)
        got = ngram_propose(np.asarray(ctx, dtype=np.int64), n_min, n_max, k).tolist()
        assert got == _brute(ctx, n_min, n_max, k), (trial, ctx, n_min, n_max, k)


def test_ngram_repeat_passage() -> None:
    passage = list(range(100, 140))
    ctx = np.asarray(passage + [7, 8] + passage[:10], dtype=np.int64)
    assert ngram_propose(ctx, 2, 4, 5).tolist() == passage[10:15]
