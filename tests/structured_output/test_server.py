"""The grammar server process (`structured_output/server.py`): compiles, matchers and step masks in a process of
its own give the same masks, rejections and ends as xgrammar in this process, and a compile error comes back as
an answer, not a dead server."""

from __future__ import annotations

import functools
import time

import numpy as np
import pytest

xgr = pytest.importorskip("xgrammar")

from pagedllm.sampling_params import StructuredOutputsParams  # noqa: E402
from pagedllm.structured_output.backend import XgrammarBackend, grammar_key  # noqa: E402
from pagedllm.structured_output.config import StructuredOutputsConfig  # noqa: E402
from pagedllm.structured_output.server import GrammarClient, ServerSpec, make_backend  # noqa: E402
from pagedllm.transformers_utils.config import default_model_path  # noqa: E402
from pagedllm.transformers_utils.tokenizer import get_tokenizer  # noqa: E402


def _wait_compiled(client: GrammarClient, keys: list, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not all(k in client.compiled for k in keys):
        assert time.monotonic() < end, "compile answers did not come"
        client.poll(0.1)


def test_server_masks_rejections_and_ends_equal_in_process() -> None:
    path = default_model_path()
    tok = get_tokenizer(path)
    cfg = StructuredOutputsConfig()
    vocab = len(tok)
    local = XgrammarBackend(tok, vocab, [tok.eos_token_id], cfg)
    words = -(-local.valid_vocab // 32)
    spec = ServerSpec(functools.partial(make_backend, path, vocab, [tok.eos_token_id], cfg), rows=4, words=words)
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
        client.step([], [], rids, 0)
        mask, _, _ = client.filled(0)
        xgr.BatchGrammarMatcher(1).batch_fill_next_token_bitmask([ref[r] for r in rids], want)
        assert np.array_equal(mask[:3], want.numpy())
        # Tokens the masks allow: '{' then '"' for r0, more string for r1, "yes" then EOS (its end) for r2.
        seq = {
            "r0": [tok.encode(t, add_special_tokens=False)[0] for t in ("{", '"')],
            "r1": [tok.encode(t, add_special_tokens=False)[0] for t in ("l", "lo")],
            "r2": [*tok.encode("yes", add_special_tokens=False), tok.eos_token_id],
        }
        for i in range(max(len(v) for v in seq.values())):
            live = [r for r in rids if i < len(seq[r])]
            toks = [seq[r][i] for r in live]
            slot = (i + 1) % spec.depth
            client.step(live, toks, rids, slot)
            for r, t in zip(live, toks):
                assert ref[r].accept_token(t)
            mask, rejected, ended = client.filled(slot)
            assert rejected == [] and ended == [r for r in live if ref[r].is_terminated()]
            for k, r in enumerate(rids):
                if ref[r].is_terminated():  # an ended grammar's row allows everything
                    assert (mask[k] == -1).all()
                else:
                    one = xgr.allocate_token_bitmask(1, local.valid_vocab)
                    ref[r].fill_next_token_bitmask(one, 0)
                    assert np.array_equal(mask[k], one.numpy()[0])
        assert ref["r2"].is_terminated()
        # A token the grammar does not allow: the synchronous feed says so.
        err, done = client.feed("r0", [tok.encode("x", add_special_tokens=False)[0]])
        assert err and "not allowed" in err and not done
        # A step's rejected token (the mask would not have allowed it) is named in the answer; the key "a" is fine.
        client.remove("r1")
        client.step(["r0"], [tok.encode("x", add_special_tokens=False)[0]], ["r0"], 1)
        assert client.filled(1)[1] == ["r0"]
        assert ref["r0"].accept_token(tok.encode("a", add_special_tokens=False)[0])
        client.step(["r0"], [tok.encode("a", add_special_tokens=False)[0]], ["r0"], 2)
        mask, rejected, _ = client.filled(2)
        one = xgr.allocate_token_bitmask(1, local.valid_vocab)
        ref["r0"].fill_next_token_bitmask(one, 0)
        assert rejected == [] and np.array_equal(mask[0], one.numpy()[0])
    finally:
        client.close()
    assert not client._proc.is_alive()
