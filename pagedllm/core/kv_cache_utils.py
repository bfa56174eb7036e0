"""Prefix-cache block hashing and the description of the KV cache per layer group."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pagedllm.core.request import Request

NONE_HASH = b"\x00" * 32


def hash_block_tokens(parent_hash: bytes, token_ids: list[int] | tuple[int, ...], extra_keys: bytes) -> bytes:
    """sha256 over (parent hash, token ids, extra keys): stable across processes and runs, unlike hash()."""
    h = hashlib.sha256(parent_hash)
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(b"|")
        h.update(extra_keys)
    return h.digest()


def request_extra_keys(request: Request, block_index: int) -> bytes:
    """Anything besides the token ids that changes the KV of a block: the cache salt (first block: it
    seeds the whole chain), the LoRA adapter, the hashes of the images whose placeholder tokens the block
    holds (the chain carries them into every later block)."""
    keys = []
    if block_index == 0 and request.cache_salt:
        keys.append(b"salt:" + request.cache_salt.encode())
    if request.lora_id is not None:
        keys.append(b"lora:" + str(request.lora_id).encode())
    if request.mm_features:
        bs = request._hash_block_size
        start, end = block_index * bs, (block_index + 1) * bs
        for f in request.mm_features:
            if f.offset < end and f.offset + f.length > start:
                keys.append(b"mm:" + f.identifier.encode())
    return b";".join(keys)


def make_block_hasher(block_size: int) -> Callable[[Request], list[bytes]]:
    """Returns a function computing the hashes of the request's not-yet-hashed full blocks."""

    sha256 = hashlib.sha256

    def hasher(request: Request) -> list[bytes]:
        hashes = request.block_hashes
        start = len(hashes)
        parent = hashes[-1] if start else NONE_HASH
        out: list[bytes] = []
        tokens = request.all_token_ids
        if not request.cache_salt and request.lora_id is None and not request.mm_features:
            # No extra keys in any block: `hash_block_tokens(parent, block, b"")` inlined, as one digest of
            # the concatenation (the same bytes as its two updates). A decode reaching a block boundary
            # hashes one block per request, all requests in the same step.
            for i in range(start, len(tokens) // block_size):
                parent = sha256(parent + array("q", tokens[i * block_size : (i + 1) * block_size]).tobytes()).digest()
                out.append(parent)
            return out
        for i in range(start, len(tokens) // block_size):
            parent = hash_block_tokens(
                parent, tokens[i * block_size : (i + 1) * block_size], request_extra_keys(request, i)
            )
            out.append(parent)
        return out

    hasher.block_size = block_size  # type: ignore[attr-defined]  # lets Request skip calls mid-block
    return hasher


@dataclass(frozen=True)
class KVCacheSpec:
    """How one group of attention layers stores KV: full attention (sliding_window None) or a window."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    sliding_window: int | None = None

    @property
    def page_size_bytes(self) -> int:
        """Bytes one block takes in one layer (K and V)."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.block_size * self.num_kv_heads * self.head_size * itemsize


@dataclass
class KVCacheGroup:
    layer_names: list[str]
    spec: KVCacheSpec


@dataclass
class KVCacheConfig:
    num_blocks: int
    groups: list[KVCacheGroup] = field(default_factory=list)


def group_layers_by_spec(specs: dict[str, KVCacheSpec]) -> list[KVCacheGroup]:
    """Layers with identical specs share one group (and one block table)."""
    groups: dict[KVCacheSpec, list[str]] = {}
    for name, spec in specs.items():
        groups.setdefault(spec, []).append(name)
    return [KVCacheGroup(names, spec) for spec, names in groups.items()]
