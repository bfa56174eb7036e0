"""The grammar server process (`structured_output/server.py`): compiles, matchers and step masks in a process of
its own give the same masks, rejections and ends as xgrammar in this process, and a compile error comes back as
an answer, not a dead server."""

from __future__ import annotations

import functools
import time
from typing import Any

import numpy as np
import pytest

xgr = pytest.importorskip("xgrammar")

from pagedllm.sampling_params import StructuredOutputsParams  # noqa: E402
from pagedllm.structured_output.backend import XgrammarBackend, grammar_key  # noqa: E402
from pagedllm.structured_output.client import GrammarClient  # noqa: E402
from pagedllm.structured_output.config import StructuredOutputsConfig  # noqa: E402
from pagedllm.structured_output.server import ServerSpec, make_backend  # noqa: E402
from pagedllm.transformers_utils.config import default_model_path  # noqa: E402
from pagedllm.transformers_utils.tokenizer import get_tokenizer  # noqa: E402


def _wait_compiled(client: GrammarClient, keys: list, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not all(k in client.compiled for k in keys):
        assert time.monotonic() < end, "compile answers did not come"
        client.poll(0.1)


@pytest.mark.parametrize("poll_s", [0.0, 5e-5], ids=["blocking", "polling"])
def test_server_masks_rejections_and_ends_equal_in_process(poll_s: float) -> None:
    """The server's masks equal in-process matchers' step by step, whether it blocks for its messages or polls
    for them while steps come (`ServerSpec.poll_s`)."""
    path = default_model_path()
    tok = get_tokenizer(path)
    cfg = StructuredOutputsConfig()
    vocab = len(tok)
    local = XgrammarBackend(tok, vocab, [tok.eos_token_id], cfg)
    words = -(-local.valid_vocab // 32)
    make = functools.partial(make_backend, local.tokenizer_info.serialize_json(), vocab, cfg)
    spec = ServerSpec(make, rows=4, words=words, poll_s=poll_s)
    client = GrammarClient(spec)
    try:
        schema = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "string"}}})
        yes = StructuredOutputsParams(choice=["yes"])
        bad = StructuredOutputsParams(regex="(unclosed")
        keys = [grammar_key(p, cfg) for p in (schema, yes, bad)]
        for k, p in zip(keys, (schema, yes, bad)):
            client.compile(k, p)
        _wait_compiled(client, keys)
        assert client.compiled[keys[0]] is None and client.compiled[keys[1]] is None
        assert client.compiled[keys[2]]  # the error's text; the server lives on
        prefix = tok.encode('{"a": "he', add_special_tokens=False)
        client.open("r0", keys[0])
        client.open("r1", keys[0], prefix)  # a request resumed with outputs: replayed
        client.open("r2", keys[1])
        ref = {r: local.matcher(local.compile(p)) for r, p in (("r0", schema), ("r1", schema), ("r2", yes))}
        for t in prefix:
            assert ref["r1"].accept_token(t)
        rids = ["r0", "r1", "r2"]
        want = xgr.allocate_token_bitmask(3, local.valid_vocab)
        client.step(1, rids, None)
        assert client.wait_mask(1, timeout=30)
        xgr.BatchGrammarMatcher(1).batch_fill_next_token_bitmask([ref[r] for r in rids], want)
        assert np.array_equal(client.mask(1)[:3], want.numpy())
        # Tokens the masks allow: '{' then '"' for r0, more string for r1, "yes" then EOS (its end) for r2; a row
        # with id -1 was not sampled (its matcher stays).
        seq = {
            "r0": [tok.encode(t, add_special_tokens=False)[0] for t in ("{", '"')],
            "r1": [tok.encode(t, add_special_tokens=False)[0] for t in ("l", "lo")],
            "r2": [*tok.encode("yes", add_special_tokens=False), tok.eos_token_id],
        }
        k = 1
        for i in range(max(len(v) for v in seq.values())):
            ids = [seq[r][i] if i < len(seq[r]) else -1 for r in rids]
            client.step(k + 1, rids, k)  # ordered before mask k's ids are there, as async scheduling does
            time.sleep(0.05)
            assert not client.wait_mask(k + 1, timeout=0.0)
            client.publish(k, ids)
            k += 1
            for r, t in zip(rids, ids):
                if t >= 0 and not ref[r].is_terminated():
                    assert ref[r].accept_token(t)
            assert client.wait_mask(k, timeout=30)
            mask = client.mask(k)
            for row, r in enumerate(rids):
                if ref[r].is_terminated():  # an ended grammar's row allows everything
                    assert (mask[row] == -1).all()
                else:
                    one = xgr.allocate_token_bitmask(1, local.valid_vocab)
                    ref[r].fill_next_token_bitmask(one, 0)
                    assert np.array_equal(mask[row], one.numpy()[0])
        assert ref["r2"].is_terminated()
        client.poll()
        assert client.failed == {}
        stats = client.request_stats()
        assert stats is not None and stats["steps"] == k and stats["fill"] > 0
        # A token the grammar does not allow: the synchronous feed says so (after mask k's ids, taken first; none
        # of its rows was sampled).
        client.publish(k, [-1, -1, -1])
        client.take(k)
        x = tok.encode("x", add_special_tokens=False)[0]
        err, done = client.feed("r0", [x])
        assert err and "not allowed" in err and not done
        # A step's rejected token (the mask would not have allowed it) fails its request; the others go on.
        client.remove("r1")
        client.step(k + 1, ["r0"], None)
        assert client.wait_mask(k + 1, timeout=30)
        client.publish(k + 1, [x])
        client.step(k + 2, ["r0", "r2"], k + 1)
        assert client.wait_mask(k + 2, timeout=30)
        client.poll(5.0)
        assert list(client.failed) == ["r0"] and "not allowed" in client.failed["r0"]
        assert (client.mask(k + 2)[:2] == -1).all()  # r0 failed (no matcher), r2 ended
    finally:
        client.close()
    assert not client.alive


def _small_server(**spec_args: Any) -> tuple[GrammarClient, StructuredOutputsConfig]:
    """A server of two rows for the built-in model's tokenizer."""
    path = default_model_path()
    tok = get_tokenizer(path)
    cfg = StructuredOutputsConfig()
    vocab = len(tok)
    local = XgrammarBackend(tok, vocab, [tok.eos_token_id], cfg)
    words = -(-local.valid_vocab // 32)
    make = functools.partial(make_backend, local.tokenizer_info.serialize_json(), vocab, cfg)
    return GrammarClient(ServerSpec(make, rows=2, words=words, **spec_args)), cfg


def test_server_step_ids_that_never_come_fail_their_requests() -> None:
    """A step whose sampled ids are not published in `timeout_s` fails its requests; the mask flag is still set
    (a device waiting on it goes on) and the server keeps serving."""
    client, cfg = _small_server(timeout_s=0.5)
    try:
        p = StructuredOutputsParams(choice=["yes", "no"])
        key = grammar_key(p, cfg)
        client.compile(key, p)
        _wait_compiled(client, [key])
        client.open("a", key)
        client.step(1, ["a"], None)
        assert client.wait_mask(1, timeout=30)
        client.step(2, ["a"], 1)  # mask 1's ids are never published
        assert client.wait_mask(2, timeout=30)
        client.poll(5.0)
        assert "did not reach" in client.failed["a"]
        client.open("b", key)
        client.step(3, ["b"], None)
        assert client.wait_mask(3, timeout=30) and not (client.mask(3)[0] == -1).all()
    finally:
        client.close()


def test_server_cache_forgets_least_recently_used() -> None:
    """Past `cache_size` compiled grammars the client forgets the least recently used (and tells the server): a
    later open of a forgotten key fails that request alone instead of the server."""
    client, cfg = _small_server(cache_size=2)
    try:
        ps = [StructuredOutputsParams(choice=[w]) for w in ("one", "two", "three")]
        keys = [grammar_key(p, cfg) for p in ps]
        for k, p in zip(keys[:2], ps[:2]):
            client.compile(k, p)
        _wait_compiled(client, keys[:2])
        assert client.lookup(keys[0]) == (True, None)  # used: keys[1] is now the oldest
        client.compile(keys[2], ps[2])
        _wait_compiled(client, [keys[2]])
        assert list(client.compiled) == [keys[0], keys[2]] and client.lookup(keys[1]) == (False, None)
        client.open("gone", keys[1])
        client.open("kept", keys[0])
        client.step(1, ["gone", "kept"], None)
        assert client.wait_mask(1, timeout=30)
        client.poll(5.0)
        assert list(client.failed) == ["gone"]
        assert (client.mask(1)[0] == -1).all() and not (client.mask(1)[1] == -1).all()
    finally:
        client.close()
