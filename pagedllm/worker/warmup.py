"""Forwards on dummy inputs before serving: the profiling forward that sizes the KV cache, and the
warm-up batches that make Triton compile its launch variants at start-up (before this, W2 on the H200
stalled ~5 s on compiles inside running steps). Neither writes to a KV cache."""

from __future__ import annotations

import time

import numpy as np
import torch

from pagedllm.attention.backends.abstract import AttentionBackend
from pagedllm.attention.ops.triton_paged_attn import SMALL_TILE_WAVES
from pagedllm.core.kv_cache_utils import KVCacheGroup
from pagedllm.forward_context import set_forward_context
from pagedllm.logger import init_logger
from pagedllm.model_executor.models.interfaces import CausalLM
from pagedllm.sample import triton_argmax, triton_sample
from pagedllm.triton_utils import num_sms
from pagedllm.utils import cdiv
from pagedllm.worker.attn_inputs import build_commons, metadata_by_layer

logger = init_logger(__name__)


def _forward(model: CausalLM, q_lens: list[int], ctx: list[int], md: dict, device: torch.device) -> torch.Tensor:
    """A forward over requests with `q_lens` new tokens after `ctx` computed ones: the logits of each last token."""
    n = sum(q_lens)
    pos = torch.cat([torch.arange(a, a + q) for q, a in zip(q_lens, ctx)]).to(device)
    with set_forward_context(md):
        hidden = model(torch.zeros(n, dtype=torch.long, device=device), pos)
    last = torch.from_numpy(np.cumsum(q_lens) - 1).to(device)
    return model.compute_logits(hidden[last])


@torch.inference_mode()
def profile_forward(
    model: CausalLM,
    backend: type[AttentionBackend],
    layer_names: list[str],
    num_tokens: int,
    num_reqs: int,
    block_size: int,
    device: torch.device,
) -> None:
    """The largest step's peak activation memory, as vLLM's profile run measures it: one forward over
    `num_tokens` dummy tokens spread evenly over `num_reqs` requests, attention skipped (the KV cache does not
    exist yet; `CommonAttentionMetadata.kv_cache_free`), then the logits of every request's last token."""
    q_lens = np.full(num_reqs, num_tokens // num_reqs)
    q_lens[: num_tokens % num_reqs] += 1
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    tables = [np.zeros((num_reqs, 1), np.int32)]
    common = build_commons(
        cu, q_lens, np.zeros(num_reqs), tables, [np.full(num_tokens, -1)], int(q_lens.max()), device, False, True
    )[0]
    md = backend.get_builder_cls()(block_size, None, device).build(common)
    pos = torch.from_numpy(np.arange(num_tokens) - np.repeat(cu[:-1], q_lens)).to(device)
    with set_forward_context(dict.fromkeys(layer_names, md)):
        hidden = model(torch.zeros(num_tokens, dtype=torch.long, device=device), pos)
        if not isinstance(hidden, tuple):  # (a pipeline stage before the last returns activations, no logits)
            model.compute_logits(hidden[torch.from_numpy(cu[1:] - 1).to(device)])


@torch.inference_mode()
def run_dummy_batches(
    model: CausalLM,
    groups: list[KVCacheGroup],
    builders: list,
    max_num_reqs: int,
    max_num_tokens: int,
    max_model_len: int,
    device: torch.device,
) -> torch.Tensor | None:
    """The warm-up's forwards (any device): slots are -1 (nothing written to the cache) and block tables
    point at the null block. Returns the last batch's logits (None if nothing ran)."""
    logits = None
    c = max(2, min(64, (max_model_len - 16) // 2))
    # Chunks of 64 get the chunk tiles; a 2-token chunk next to a decode gets decode tiles (what a step whose
    # budget leaves a prompt's last few tokens runs); decode batches of 1..64 requests compile the split-KV
    # variants that eager decoding (no CUDA graphs) picks by batch size.
    shapes = [([c], [0]), ([1, c], [16, 0]), ([1, c, c], [16, 0, 16]), ([1, 2], [16, 0])]
    if device.type == "cuda":  # Triton's variants: steps of a few tokens per request (speculative verification,
        # short prompts) take one-tile launches of 16 or 32 rows (`one_tile_rows`, by the GQA group), alone and
        # beside a decode. (Before the decode batches, so that the last batch, whose logits warm up the sampler,
        # stays the largest decode batch.)
        shapes += [s for q in (4, 8, 16, 32) for s in (([q], [0]), ([1, q], [16, 0]))]
    if device.type == "cuda":
        shapes += _longest_first_shapes(groups, max_num_reqs, c, device)
    shapes += [([1] * k, [16] * k) for k in (1, 2, 4, 8, 16, 32, 64) if k <= max_num_reqs]
    # Models whose image tokens see their whole image: the attention's key-limit variants too (first two shapes).
    limited = bool(getattr(model, "requires_whole_mm_items", False))
    for i, (q_lens, ctx) in enumerate(shapes + (shapes[:2] if limited else [])):
        n = sum(q_lens)
        seq = np.array(q_lens) + np.array(ctx)
        if n > max_num_tokens or int(seq.max()) > max_model_len:
            continue
        cu = np.concatenate([[0], np.cumsum(q_lens)])
        tables = [np.zeros((len(q_lens), cdiv(int(seq.max()), g.spec.block_size)), np.int32) for g in groups]
        slots = [np.full(n, -1, dtype=np.int64) for _ in groups]
        limit = None
        if i >= len(shapes):  # (each token's own position: the causal result, through the key-limit variant)
            limit = np.concatenate([np.arange(a, a + q) for q, a in zip(q_lens, ctx)])
        commons = build_commons(cu, seq, np.array(ctx), tables, slots, max(q_lens), device, key_limit=limit)
        logits = _forward(model, q_lens, ctx, metadata_by_layer(builders, groups, commons), device)
    return logits


def _longest_first_shapes(
    groups: list[KVCacheGroup], max_num_reqs: int, chunk: int, device: torch.device
) -> list[tuple[list[int], list[int]]]:
    """Batches at the first size of each longest-first decode launch (`triton_paged_attn.wants_request_order`
    and `ordered_tile_n`: more (request, kv head) programs than SMs; SMALL_TILE_WAVES per SM), as decodes alone
    and beside a chunk (the mixed step's decode launch, a variant of its own). Without them W6 compiled two
    variants in its first mixed steps (benchmarks/NOTES.md, session 30)."""
    sms = num_sms(device)
    sizes: set[int] = set()
    for g in groups:
        kvh = int(getattr(g.spec, "num_kv_heads", 0) or 0)
        if kvh:
            sizes |= {sms // kvh + 1, -(-SMALL_TILE_WAVES * sms // kvh)}
    shapes = []
    for k in sorted(k for k in sizes if 1 < k <= max_num_reqs):
        shapes += [([1] * k, [16] * k), ([1] * (k - 1) + [chunk], [16] * (k - 1) + [0])]
    return shapes


def warm_up_kernels(
    logits: torch.Tensor | None, device: torch.device, t0: float, model: torch.nn.Module, max_num_tokens: int
) -> None:
    """After `run_dummy_batches` on a GPU: the greedy argmax's and the one-pass sampler's variants too (seeded
    rows present, and keys made in the kernel), and every module's own `warm_up_kernels(max_num_tokens)` where it
    has one (launch variants that the dummy batches' few tokens do not reach, e.g. the fused MoE's prefill-sized
    tiles)."""
    for module in model.modules():
        hook = getattr(module, "warm_up_kernels", None)
        if callable(hook):
            hook(max_num_tokens)
    if logits is not None:  # the greedy rows' split argmax: one variant for every row count, per logits dtype
        for x in (logits, logits.float()):
            if triton_argmax.usable(x):
                triton_argmax.argmax_rows(x)
    if logits is not None and triton_sample.usable(logits := logits.float()):
        n = logits.shape[0]
        keys = torch.zeros(n, dtype=torch.int64, device=device)
        triton_sample.gumbel_sample(logits, torch.ones(n, device=device), keys)
        triton_sample.gumbel_sample(logits, torch.ones(n, device=device), None)
    torch.cuda.synchronize()
    logger.info("Kernel warm-up (attention variants, sampling) in %.2f s", time.perf_counter() - t0)
