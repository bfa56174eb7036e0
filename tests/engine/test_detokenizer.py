"""IncrementalDetokenizer: streaming text equals the full decode; UTF-8 hold-back; stop strings."""

from __future__ import annotations

import random
from typing import Any

import pytest

from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.sampling_params import SamplingParams

TEXTS = [
    "Hello world! This is a plain English sentence.",
    "Emoji: 👋🏽 🎉🎉 👨‍👩‍👧‍👦 done",
    "中文测试：你好，世界！日本語のテキスト。한국어 텍스트.",
    "Mixed 🙂 中文 and   multiple   spaces\n\nnew lines\ttabs",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\nIt is 4.<|im_end|>",
    "Code: def f(x):\n    return x ** 2  # ünïcödé",
]


def _params(**kw: Any) -> SamplingParams:
    kw.setdefault("max_tokens", None)
    return SamplingParams(**kw)


def _stream(
    tok: Any,
    ids: list[int],
    params: SamplingParams,
    *,
    chunk: int = 1,
    prompt: list[int] | None = None,
    stop_terminated: bool = False,
) -> tuple[IncrementalDetokenizer, list[str], str | None]:
    """Feed `ids` in chunks; return the detokenizer, the DELTA texts and the stop string hit (if any)."""
    d = IncrementalDetokenizer(tok, params, prompt)
    deltas: list[str] = []
    stop = None
    for i in range(0, len(ids), chunk):
        piece = ids[i : i + chunk]
        last = i + chunk >= len(ids)
        stop = d.update(piece, stop_terminated and last, finished=last)
        finished = last or stop is not None
        deltas.append(d.get_next_output_text(finished, delta=True))
        if stop is not None:
            break
    return d, deltas, stop


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_text_equals_full_decode(smollm2_tokenizer: Any, skip: bool, chunk: int) -> None:
    tok = smollm2_tokenizer
    prompt = tok.encode("<|im_start|>assistant\n")
    for text in TEXTS:
        ids = tok.encode(text)
        d, deltas, _ = _stream(tok, ids, _params(skip_special_tokens=skip), chunk=chunk, prompt=prompt)
        expected = tok.decode(ids, skip_special_tokens=skip)
        assert d.output_text == expected
        assert "".join(deltas) == expected
        assert d.token_ids == ids


def test_random_token_sequences_match_full_decode(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    rng = random.Random(1234)
    vocab = len(tok)
    for _ in range(300):
        skip = rng.random() < 0.5
        # Low ids are the single-byte tokens (incl. lone UTF-8 lead/continuation bytes) and specials.
        ids = [rng.randrange(vocab) if rng.random() < 0.6 else rng.randrange(300) for _ in range(rng.randint(1, 30))]
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 8))]
        d, deltas, _ = _stream(tok, ids, _params(skip_special_tokens=skip), chunk=rng.randint(1, 3), prompt=prompt)
        expected = tok.decode(ids, skip_special_tokens=skip)
        assert d.output_text == expected, (prompt, ids)
        assert "".join(deltas) == expected


def test_multibyte_characters_are_held_back_until_complete(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    text = "a👋🏽b你好🎉"
    ids = tok.encode(text)
    assert len(ids) > len(text)  # several tokens are partial characters
    d = IncrementalDetokenizer(tok, _params())
    held = 0
    for i, t in enumerate(ids):
        d.update([t], False, finished=i == len(ids) - 1)
        assert "\ufffd" not in d.output_text
        held += d.output_text != tok.decode(ids[: i + 1])
    assert held > 0
    assert d.output_text == text


def test_incomplete_character_flushed_only_when_finished(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    ids = tok.encode("ok 🎉")[:-1]  # cut inside the emoji's bytes
    full = tok.decode(ids)
    assert full.endswith("\ufffd")
    d = IncrementalDetokenizer(tok, _params())
    d.update(ids, False)
    assert d.output_text == "ok "  # the complete characters before the partial one
    d.update([], False, finished=True)
    assert d.output_text == full


def test_stop_string_spanning_tokens(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    ids = tok.encode("Hello world. The end is near.")
    d, deltas, stop = _stream(tok, ids, _params(stop=["d. T"]))
    assert stop == "d. T"
    assert d.output_text == "Hello worl"
    assert "".join(deltas) == "Hello worl"


def test_include_stop_str_in_output(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    ids = tok.encode("Hello world. The end is near.")
    d, deltas, stop = _stream(tok, ids, _params(stop=["d. T"], include_stop_str_in_output=True))
    assert stop == "d. T"
    assert d.output_text == "Hello world. T"
    assert "".join(deltas) == "Hello world. T"


def test_stop_string_inside_one_token_cuts_mid_token(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    ids = tok.encode("The answer is forty-two, obviously.")
    d, _, stop = _stream(tok, ids, _params(stop=["rty"]), chunk=2)
    assert stop == "rty"
    assert d.output_text == "The answer is fo"
    # token ids are kept as generated, even past the stop string
    assert len(d.token_ids) >= 1


def test_earliest_completing_stop_string_wins(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    ids = tok.encode("alpha beta gamma delta")
    # all in one step: "gamma" completes before "delta", whatever the list order
    d = IncrementalDetokenizer(tok, _params(stop=["delta", "gamma"]))
    assert d.update(ids, False) == "gamma"
    assert d.output_text == "alpha beta "


def test_min_tokens_defers_stop_strings(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    ids = tok.encode("stop here, then more text, stop again")
    first = tok.decode(ids[:1])
    assert "stop" in first
    # without min_tokens the first token already stops
    d, _, stop = _stream(tok, ids, _params(stop=["stop"]))
    assert stop == "stop" and d.output_text == "" and len(d.token_ids) == 1
    # with min_tokens the early occurrence is ignored and the later one stops
    d, _, stop = _stream(tok, ids, _params(stop=["stop"], min_tokens=3))
    assert stop == "stop"
    assert d.output_text == "stop here, then more text, "


def test_min_tokens_reached_exactly_allows_stop(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    ids = tok.encode("one two three four")
    n_before_three = len(tok.encode("one two"))
    d, _, stop = _stream(tok, ids, _params(stop=[" three"], min_tokens=n_before_three + 1))
    assert stop == " three"
    assert d.output_text == "one two"


@pytest.mark.parametrize("chunk", [1, 2])
def test_delta_never_leaks_partial_stop_string(smollm2_tokenizer: Any, chunk: int) -> None:
    tok = smollm2_tokenizer
    text = "We say STO and STOP NOW and STOP!! then more words"
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok, _params(stop=["STOP!!"]))
    streamed = ""
    snapshots = []
    stop = None
    for i in range(0, len(ids), chunk):
        stop = d.update(ids[i : i + chunk], False)
        streamed += d.get_next_output_text(stop is not None, delta=True)
        snapshots.append(streamed)
        if stop is None:
            # the withheld tail is exactly the stop buffer
            assert len(d.output_text) - len(streamed) == min(len(d.output_text), len("STOP!!") - 1)
        else:
            break
    assert stop == "STOP!!"
    # nothing streamed was ever taken back: each snapshot is a prefix of the final text
    assert all(d.output_text.startswith(s) for s in snapshots)
    assert streamed == d.output_text == "We say STO and STOP NOW and "


def test_cumulative_output_withholds_stop_buffer_until_finished(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    d = IncrementalDetokenizer(tok, _params(stop=["###"]))
    d.update(tok.encode("Hello there"), False)
    assert d.get_next_output_text(False, delta=False) == "Hello the"
    assert d.get_next_output_text(True, delta=False) == "Hello there"
    # include_stop_str_in_output needs no buffer
    d = IncrementalDetokenizer(tok, _params(stop=["###"], include_stop_str_in_output=True))
    d.update(tok.encode("Hello there"), False)
    assert d.get_next_output_text(False, delta=False) == "Hello there"


@pytest.mark.parametrize("skip", [True, False])
def test_stop_terminated_excludes_stop_token_text(smollm2_tokenizer: Any, skip: bool) -> None:
    tok = smollm2_tokenizer
    ids = tok.encode("The answer.") + [tok.eos_token_id]
    d = IncrementalDetokenizer(tok, _params(skip_special_tokens=skip))
    d.update(ids[:-1], False)
    d.update(ids[-1:], True, finished=True)
    assert d.output_text == "The answer."
    assert d.token_ids == ids


def test_stop_token_id_included_with_include_stop_str(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    ids = tok.encode("The answer.")
    params = _params(stop_token_ids=[ids[-1]], include_stop_str_in_output=True)
    d = IncrementalDetokenizer(tok, params)
    d.update(ids, True, finished=True)
    assert d.output_text == "The answer."
    d = IncrementalDetokenizer(tok, _params(stop_token_ids=[ids[-1]]))
    d.update(ids, True, finished=True)
    assert d.output_text == tok.decode(ids[:-1])
    assert d.token_ids == ids


def test_special_tokens_kept_when_not_skipped(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    d, _, _ = _stream(tok, ids, _params(skip_special_tokens=False, spaces_between_special_tokens=False))
    assert d.output_text == "<|im_start|>user\nhi<|im_end|>"
    d, _, _ = _stream(tok, ids, _params(skip_special_tokens=True))
    assert d.output_text == "user\nhi"


def test_no_detokenize_or_no_tokenizer_tracks_ids_only(smollm2_tokenizer: Any) -> None:
    d = IncrementalDetokenizer(smollm2_tokenizer, _params(detokenize=False))
    assert d.update([100, 200], False) is None
    assert d.output_text == "" and d.token_ids == [100, 200]
    assert d.get_next_output_text(True, delta=True) == ""
    d = IncrementalDetokenizer(None, _params())
    d.update([5], True, finished=True)
    assert d.output_text == "" and d.token_ids == [5]


def test_get_tokenizer_cache_and_errors(smollm2_path: str, smollm2_tokenizer: Any) -> None:
    import os

    from pagedllm.transformers_utils.tokenizer import get_cached_tokenizer_info, get_tokenizer

    assert get_tokenizer(smollm2_path) is smollm2_tokenizer
    # directory + gguf_file (path or basename) resolve to the same cached tokenizer
    d = os.path.dirname(smollm2_path)
    assert get_tokenizer(d, gguf_file=smollm2_path) is smollm2_tokenizer
    assert get_tokenizer(d, gguf_file=os.path.basename(smollm2_path)) is smollm2_tokenizer
    with pytest.raises(ValueError, match="tokenizer_mode"):
        get_tokenizer(smollm2_path, tokenizer_mode="mistral")
    with pytest.raises(ValueError, match="trust_remote_code"):
        get_tokenizer(smollm2_path, trust_remote_code=True)
    info = get_cached_tokenizer_info(smollm2_tokenizer)
    assert info is get_cached_tokenizer_info(smollm2_tokenizer)
    assert info.vocab_size == len(smollm2_tokenizer) and smollm2_tokenizer.eos_token_id in info.all_special_ids
