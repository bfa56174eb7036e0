"""The scheduler's view of the worker's encoder cache (vLLM's EncoderCacheManager + encoder budget).

A request's images are encoded in the step whose scheduled tokens first reach their placeholder range,
and their outputs stay on the worker, keyed by image hash, while any request still has placeholder tokens
of that image to compute: so chunked prefill can split a prompt inside an image (each chunk takes its
slice of the cached output), and an image already cached is never encoded again (`hits`). Each step may
encode at most `budget` placeholder tokens' worth of images, and the cache holds at most `capacity` rows;
an image that does not fit ends the request's chunk just before its placeholder. Entries no request
references are dropped lazily (least recently released first) when room is needed, and the worker is told
which (`take_freed`).

`whole_items` (vLLM's `disable_chunked_mm_input`): a chunk never ends inside an image; it stops before the
image, and a request whose next tokens start with (or, after a prefix-cache hit, lie inside) an image that
does not fit the step's remaining budget waits for a later step (`whole_item_cuts` counts those cuts)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any


class EncoderCacheManager:
    def __init__(self, budget: int, capacity: int, whole_items: bool = False) -> None:
        self.budget = budget
        self.capacity = capacity
        self.whole_items = whole_items
        self.whole_item_cuts = 0
        """Chunks cut back (or requests held) so that an image is not split (`whole_items`)."""
        self.cached: dict[str, int] = {}
        """Image hash -> rows, for every output held on the worker (or scheduled to be computed)."""
        self.refs: dict[str, set[str]] = {}
        self.freeable: OrderedDict[str, int] = OrderedDict()
        """Cached entries no request references (evicted first when room is needed)."""
        self.used = 0
        self._freed: list[str] = []
        self._step_used = 0
        self.hits = 0
        """Images whose output was already cached when a request needed it."""
        self.encoded = 0
        """Images sent to the encoder."""

    def begin_step(self) -> None:
        self._step_used = 0

    def plan(self, req: Any, computed: int, num_new: int) -> tuple[int, list[int]]:
        """(tokens the request may compute this step, indexes of its images to encode): `num_new` cut back
        to just before the first image that neither is cached nor fits this step's budget and the cache."""
        to_encode: list[int] = []
        step_used, end = self._step_used, computed + num_new
        room = self.capacity - self.used + sum(self.freeable.values())
        for i, f in enumerate(req.mm_features):
            if f.offset >= end:
                break
            if f.offset + f.length <= computed:
                continue  # already in the KV cache
            if self.whole_items and f.offset + f.length > end:
                self.whole_item_cuts += 1
                return max(0, f.offset - computed), to_encode
            if f.identifier in self.cached or any(req.mm_features[j].identifier == f.identifier for j in to_encode):
                continue
            fits_budget = step_used == 0 or step_used + f.length <= self.budget
            fits_cache = f.length <= room or self.used - sum(self.freeable.values()) == 0
            if not (fits_budget and fits_cache):
                return max(0, f.offset - computed), to_encode
            to_encode.append(i)
            step_used += f.length
            room -= f.length
        return num_new, to_encode

    def commit(self, req: Any, computed: int, num_new: int, to_encode: list[int]) -> None:
        """Records a planned request as scheduled: its images met this step are referenced (and the new ones
        allocated), those whose placeholders it has passed are released."""
        end = computed + num_new
        rid = req.request_id
        for i, f in enumerate(req.mm_features):
            h = f.identifier
            if f.offset + f.length <= computed:
                self._unref(h, rid)
            elif f.offset < end:
                refs = self.refs.setdefault(h, set())
                if rid not in refs:
                    if i not in to_encode:
                        self.hits += 1
                    refs.add(rid)
                    self.freeable.pop(h, None)
        for i in to_encode:  # after the references above, so that room is never made by evicting a hit
            f = req.mm_features[i]
            self._make_room(f.length)
            self.cached[f.identifier] = f.length
            self.used += f.length
            self._step_used += f.length
            self.encoded += 1

    def release(self, req: Any) -> None:
        """The request finished or was preempted: it references none of its images any more."""
        for f in req.mm_features:
            self._unref(f.identifier, req.request_id)

    def _unref(self, h: str, rid: str) -> None:
        refs = self.refs.get(h)
        if refs is None or rid not in refs:
            return
        refs.discard(rid)
        if not refs:
            del self.refs[h]
            if h in self.cached:
                self.freeable[h] = self.cached[h]

    def _make_room(self, rows: int) -> None:
        while self.used + rows > self.capacity and self.freeable:
            h, n = self.freeable.popitem(last=False)
            del self.cached[h]
            self.used -= n
            self._freed.append(h)

    def take_freed(self) -> list[str]:
        """Hashes evicted since the last call (the worker drops their outputs)."""
        out, self._freed = self._freed, []
        return out

    def reset(self) -> None:
        """Forget every cached output (e.g. after a weight update); referenced entries stay."""
        for h, n in list(self.freeable.items()):
            del self.cached[h]
            self.used -= n
            self._freed.append(h)
        self.freeable.clear()
