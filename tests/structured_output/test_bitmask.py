"""The step bitmask when the model's vocabulary is padded past the tokenizer's (real checkpoints pad a few
hundred ids; a benchmark pairing a 49k tokenizer with a 152k model pads 100k): xgrammar fills only the
tokenizer's ids (padding ids it cannot read made its fill ~100x slower), and the padded ids are disallowed in
constrained rows and allowed in unconstrained (terminated) ones."""

from __future__ import annotations

import numpy as np
import pytest

xgr = pytest.importorskip("xgrammar")

from pagedllm.sampling_params import StructuredOutputsParams  # noqa: E402
from pagedllm.structured_output.backend import XgrammarBackend  # noqa: E402
from pagedllm.structured_output.config import StructuredOutputsConfig  # noqa: E402
from pagedllm.structured_output.manager import GrammarBitmask  # noqa: E402
from pagedllm.transformers_utils.config import default_model_path  # noqa: E402
from pagedllm.transformers_utils.tokenizer import get_tokenizer  # noqa: E402


def _allowed(mask: np.ndarray, vocab: int) -> np.ndarray:
    bits = np.unpackbits(np.ascontiguousarray(mask).view(np.uint8), axis=1, bitorder="little")
    return bits[:, :vocab].astype(bool)


def test_padded_vocab_bitmask() -> None:
    tok = get_tokenizer(default_model_path())
    tv = len(tok)
    vocab = tv + 1000 + 7  # padded, and not a multiple of 32
    be = XgrammarBackend(tok, vocab, [tok.eos_token_id], StructuredOutputsConfig())
    assert be.valid_vocab == tv
    digits = be.compile(StructuredOutputsParams(regex="[0-9]{1,3}"))
    done = be.matcher(be.compile(StructuredOutputsParams(choice=["yes"])))
    for t in tok.encode("yes", add_special_tokens=False):
        assert done.accept_token(t)
    assert done.accept_token(tok.eos_token_id) and done.is_terminated()
    live = be.matcher(digits)
    mask = GrammarBitmask([live, done], vocab, xgr.BatchGrammarMatcher(), be.valid_vocab).result()
    assert mask.shape == (2, -(-vocab // 32)) and mask.dtype == np.int32
    allowed = _allowed(mask, vocab)
    # Row 0 equals xgrammar's own fill over the tokenizer's ids, and no padded id is allowed.
    ref = xgr.allocate_token_bitmask(1, tv)
    be.matcher(digits).fill_next_token_bitmask(ref, 0)
    assert np.array_equal(allowed[0, :tv], _allowed(ref.numpy(), tv)[0])
    assert not allowed[0, tv:].any() and allowed[0, :tv].sum() > 0
    assert allowed[0, tok.encode("7", add_special_tokens=False)[0]]
    assert not allowed[0, tok.encode("x", add_special_tokens=False)[0]]
    # Row 1 (terminated): unconstrained, padded ids included.
    assert allowed[1].all()


def test_fill_overwrites_whole_rows() -> None:
    """`GrammarBitmask` leaves a filled row's buffer as it finds it (a reused pinned buffer) and relies on xgrammar
    writing every word of each row it fills, batched or alone; rows it does not fill (terminated grammars) are set
    to all-allowed."""
    import torch

    tok = get_tokenizer(default_model_path())
    be = XgrammarBackend(tok, len(tok), [tok.eos_token_id], StructuredOutputsConfig())
    g = be.compile(StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "string"}}}))
    ms = [be.matcher(g) for _ in range(3)]
    for t in tok.encode('{"a": "hel', add_special_tokens=False):
        assert ms[1].accept_token(t)
    words = -(-be.valid_vocab // 32)
    clean = torch.full((3, words), -1, dtype=torch.int32)
    dirty = torch.randint(-(2**31), 2**31 - 1, (3, words), dtype=torch.int32)
    batch = xgr.BatchGrammarMatcher(1)
    batch.batch_fill_next_token_bitmask(ms, clean)
    batch.batch_fill_next_token_bitmask(ms, dirty)
    assert torch.equal(clean, dirty)
    one = torch.randint(-(2**31), 2**31 - 1, (3, words), dtype=torch.int32)
    ms[1].fill_next_token_bitmask(one, 1)
    assert torch.equal(one[1], clean[1])
    # Through GrammarBitmask with a terminated row in the middle: it is all-allowed, the others xgrammar's.
    done = be.matcher(be.compile(StructuredOutputsParams(choice=["yes"])))
    for t in [*tok.encode("yes", add_special_tokens=False), tok.eos_token_id]:
        assert done.accept_token(t)
    assert done.is_terminated()
    mask, rows = GrammarBitmask([ms[0], done, ms[1]], be.valid_vocab, batch, be.valid_vocab).narrow()
    assert rows == [0, 2]
    assert (mask[1] == -1).all() and torch.equal(mask[0], clean[0]) and torch.equal(mask[2], clean[1])
