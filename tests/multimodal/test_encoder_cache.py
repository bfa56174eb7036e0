"""The scheduler's encoder-cache bookkeeping (`multimodal/encoder_cache.py`) on plain request stand-ins:
chunks cut before an image that does not fit the step's encoder budget or the cache, hits for cached
images, references released once a request has passed an image, lazy eviction reported to the worker."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.multimodal.encoder_cache import EncoderCacheManager


@dataclass
class F:
    identifier: str
    offset: int
    length: int


@dataclass
class R:
    request_id: str
    mm_features: list[F] = field(default_factory=list)


def test_budget_cuts_the_chunk_before_the_image_that_does_not_fit() -> None:
    enc = EncoderCacheManager(budget=10, capacity=100)
    enc.begin_step()
    a = R("a", [F("x", 2, 8), F("y", 12, 8)])
    n, todo = enc.plan(a, 0, 30)
    assert (n, todo) == (12, [0])  # y would exceed the 10-row budget: the chunk stops at its placeholder
    enc.commit(a, 0, n, todo)
    assert enc.encoded == 1 and enc.cached == {"x": 8}
    enc.begin_step()
    n, todo = enc.plan(a, 12, 18)
    assert (n, todo) == (18, [1])
    enc.commit(a, 12, n, todo)
    assert "x" not in enc.refs  # passed: no longer referenced, kept as freeable
    assert list(enc.freeable) == ["x"]


def test_an_image_larger_than_the_budget_still_runs_alone() -> None:
    enc = EncoderCacheManager(budget=4, capacity=4)
    enc.begin_step()
    a = R("a", [F("big", 0, 9)])
    n, todo = enc.plan(a, 0, 9)
    assert (n, todo) == (9, [0])


def test_hits_and_eviction() -> None:
    enc = EncoderCacheManager(budget=100, capacity=10)
    enc.begin_step()
    a, b = R("a", [F("x", 0, 6)]), R("b", [F("x", 3, 6)])
    enc.commit(a, 0, 6, enc.plan(a, 0, 6)[1])
    n, todo = enc.plan(b, 0, 9)
    assert todo == [] and n == 9
    enc.commit(b, 0, 9, todo)
    assert (enc.encoded, enc.hits) == (1, 1)
    enc.release(a)
    enc.release(b)
    assert list(enc.freeable) == ["x"]
    c = R("c", [F("z", 0, 6)])
    enc.begin_step()
    n, todo = enc.plan(c, 0, 6)
    enc.commit(c, 0, n, todo)
    assert enc.take_freed() == ["x"] and enc.take_freed() == []
    # Cache full of referenced entries: a new image waits (chunk cut to before it).
    d = R("d", [F("w", 2, 6)])
    enc.begin_step()
    assert enc.plan(d, 0, 8) == (2, [])


def test_whole_items_move_the_chunk_boundary_before_an_image() -> None:
    """`disable_chunked_mm_input`: a chunk never ends inside an image (without it, the same plan splits it)."""
    a = R("a", [F("x", 4, 8)])
    split = EncoderCacheManager(budget=100, capacity=100)
    split.begin_step()
    assert split.plan(a, 0, 10) == (10, [0])  # tokens 4..9 of the image now, the rest next step
    whole = EncoderCacheManager(budget=100, capacity=100, whole_items=True)
    whole.begin_step()
    assert whole.plan(a, 0, 10) == (4, [])  # stops before the image
    assert whole.whole_item_cuts == 1
    assert whole.plan(a, 4, 6) == (0, [])  # the image starts the chunk and does not fit: wait
    assert whole.plan(a, 4, 8) == (8, [0])  # fits: the whole image in one step
    assert whole.plan(a, 0, 12) == (12, [0])
    # A prefix-cache hit that ends inside the image: the rest of it must come in one step.
    assert whole.plan(a, 7, 3) == (0, [])
    assert whole.plan(a, 7, 5) == (5, [0])
    assert whole.whole_item_cuts == 3
