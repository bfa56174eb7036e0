"""One-pass random sampling on the GPU (Triton): the Gumbel-max form of the exponential race.

`argmax_i (p_i / q_i)` with q_i ~ Exp(1) picks token i with probability p_i (what `random_sample` does on
the CPU); with p = softmax(l / T) it equals `argmax_i (l_i / T - log q_i)`, so neither the softmax nor the
probabilities need to exist: one kernel reads each row's logits once, draws its noise from Philox
(keyed per row, counted by column) and keeps a running argmax, each row cut into chunks raced by programs of
their own and reduced by the row's last program. The unfused
chain (divide by T, softmax, uniform, clamp, log, negate, divide, max) made ~15 passes over a
[rows, vocab] float32 matrix: 0.7 ms per W1 step at 256 rows x 152k on the H200.

Rows whose logits were masked to -inf (top-k, top-p, min-p, allowed ids, ...) never win. A seeded request
gets a Philox key per output token from its seed and the token's index (`noise_keys`, from the model
runner), so a seed reproduces whatever else is in the batch, also across preemption; other rows get a
fresh key per step.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedllm import envs
from pagedllm.logger import init_logger
from pagedllm.triton_utils import HAS_TRITON, num_sms

logger = init_logger(__name__)

_BLOCK_V = 4096
_MAX_SPLIT = 32  # programs per row at most
_ROW_STRIDE = 0x9E3779B97  # unseeded rows' keys base + row * stride: distinct for every row
_MAX_BASE = 2**62  # base + row * stride < 2^63 up to 2^20 rows (stride < 2^42)

if HAS_TRITON:
    import triton
    import triton.language as tl

    from pagedllm.sample.triton_argmax import split_partials, store_row_argmax

    _ROW_STRIDE_C = tl.constexpr(_ROW_STRIDE)

    @triton.jit
    def _race(best, best_idx, logits_row, cols, vocab, u, inv_t):
        """Fold one tile of scores (l / T - log(-log u)) into the running per-lane maximum."""
        ok = cols < vocab
        lg = tl.load(logits_row + cols, mask=ok, other=float("-inf")).to(tl.float32)
        # q = -log(u) ~ Exp(1); u == 0 gives q = inf, a score of -inf.
        score = tl.where(ok, lg * inv_t - tl.log(-tl.log(u)), float("-inf"))
        better = score > best
        return tl.where(better, score, best), tl.where(better, cols, best_idx)

    # base_key is a fresh random number every step: no "== 1" / "divisible by 16" variants of it.
    @triton.jit(do_not_specialize=["base_key", "split"])
    def _gumbel_argmax_kernel(
        logits_ptr,
        temp_ptr,
        keys_ptr,
        base_key,
        out_ptr,
        val_ptr,
        idx_ptr,
        cnt_ptr,
        vocab,
        stride_row,
        chunk,
        split,
        HAS_KEYS: tl.constexpr,
        BLOCK_V: tl.constexpr,
        MAX_SPLIT: tl.constexpr,
    ):
        """Program (row, s) races columns [s * chunk, (s + 1) * chunk) of its row (chunk: a multiple of BLOCK_V),
        with the row's Philox key (HAS_KEYS: from keys_ptr, else `base_key + row * _ROW_STRIDE`, distinct per
        row); each Philox call gives 4 uniforms (`rand4x`), one for each quarter of a BLOCK_V tile, counted by
        the tile's absolute column, so the noise of a column does not depend on `split`. With split > 1 the last
        program of a row to finish (an atomic counter it resets) reduces the chunks' (best score, index). `split` is
        a runtime value (at most MAX_SPLIT): one compiled kernel for every batch size."""
        Q: tl.constexpr = BLOCK_V // 4
        row = tl.program_id(0).to(tl.int64)
        s = tl.program_id(1)
        inv_t = 1.0 / tl.load(temp_ptr + row)
        if HAS_KEYS:
            key = tl.load(keys_ptr + row)
        else:
            key = base_key + row * _ROW_STRIDE_C
        logits_row = logits_ptr + row * stride_row
        offs = tl.arange(0, Q)
        best = tl.full([Q], float("-inf"), dtype=tl.float32)
        best_idx = tl.zeros([Q], dtype=tl.int32)
        start = s * chunk
        for v0 in range(start, tl.minimum(start + chunk, vocab), BLOCK_V):
            u0, u1, u2, u3 = tl.rand4x(key, (v0 // 4 + offs).to(tl.uint32))
            best, best_idx = _race(best, best_idx, logits_row, v0 + offs, vocab, u0, inv_t)
            best, best_idx = _race(best, best_idx, logits_row, v0 + Q + offs, vocab, u1, inv_t)
            best, best_idx = _race(best, best_idx, logits_row, v0 + 2 * Q + offs, vocab, u2, inv_t)
            best, best_idx = _race(best, best_idx, logits_row, v0 + 3 * Q + offs, vocab, u3, inv_t)
        top = tl.max(best, axis=0)
        # The lowest column among the lanes holding the maximum (ties: the first index, as argmax).
        idx = tl.min(tl.where(best == top, best_idx, 2147483647), axis=0)
        store_row_argmax(top, idx, row, s, split, out_ptr, val_ptr, idx_ptr, cnt_ptr, MAX_SPLIT)


def split_of(rows: int, vocab: int, sms: int) -> int:
    """Programs per row: enough for ~8 per SM in all (one per row left the H200 latency-bound: 145 us for 256
    rows x 152k columns, ~4x the read's time), each at least two BLOCK_V tiles."""
    return max(1, min(-(-8 * sms // max(1, rows)), -(-vocab // (2 * _BLOCK_V)), _MAX_SPLIT))


def row_seeds(seeds: np.ndarray, index: np.ndarray) -> np.ndarray:
    """Philox keys, one per row, from (seed, index) pairs: splitmix64 of seed * 2^20 + index, as int64.
    A seeded request's key for its i-th output token depends on nothing else (batch, preemption)."""
    with np.errstate(over="ignore"):
        z = seeds.astype(np.uint64) * np.uint64(1 << 20) + index.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(1)).astype(np.int64)  # 63 bits: a non-negative int64


def noise_keys(
    n: int, seeded_rows: np.ndarray | None = None, seeds: np.ndarray | None = None, index: np.ndarray | None = None
) -> np.ndarray:
    """The Philox keys of a step's n rows: rows `seeded_rows` from their (seed, output index), the others
    from a fresh step key (torch's default CPU generator: a global seed repeats runs) and their row."""
    step = int(torch.randint(0, 2**62, (1,)).item())
    keys = row_seeds(np.full(n, step, dtype=np.int64), np.arange(n, dtype=np.int64))
    if seeded_rows is not None and len(seeded_rows):
        assert seeds is not None and index is not None
        keys[seeded_rows] = row_seeds(seeds, index)
    return keys


_state = {"compiled": False, "broken": False}
"""compiled: the kernel was built; broken: its build failed (the sampler falls back)."""


def usable(logits: torch.Tensor) -> bool:
    """CUDA logits, Triton present, not switched off (PAGEDLLM_ONE_PASS_SAMPLING=0), and the kernel has not
    failed to build here (then the sampler keeps its unfused path for the rest of the process)."""
    return (
        HAS_TRITON
        and not _state["broken"]
        and logits.is_cuda
        and logits.dim() == 2
        and logits.stride(-1) == 1
        and envs.PAGEDLLM_ONE_PASS_SAMPLING
    )


def step_key() -> int:
    """A fresh Philox base key for a step's unseeded rows, from torch's default CPU generator (a global seed
    repeats runs)."""
    return int(torch.randint(0, _MAX_BASE, (1,)).item())


def gumbel_sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    keys: torch.Tensor | None,
    base_key: int | None = None,
    split: int | None = None,
) -> torch.Tensor | None:
    """One sample per row from softmax(logits / temperature) (temperature > 0 per row), as int64 ids;
    `keys` [rows] int64 are the rows' Philox keys (`noise_keys`); None keys every row from `base_key`
    (default: a fresh `step_key()`) and its row index in the kernel, with no key upload. None if the kernel
    cannot be built on this machine (logged once; `usable` is False from then on). `split` (programs per row,
    default `split_of`) does not change the draws."""
    if _state["broken"]:
        return None
    n, vocab = logits.shape
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n == 0:
        return out
    temp = temperature.to(torch.float32).contiguous()
    if split is None:  # (the Triton interpreter's CPU tensors: as for a 16-SM device)
        split = split_of(n, vocab, num_sms(logits.device) if logits.is_cuda else 16)
    chunk, split, vals, idxs, cnt = split_partials(logits, split, _BLOCK_V, "gumbel")
    assert 1 <= split <= _MAX_SPLIT
    try:
        if keys is None and base_key is None:
            base_key = step_key()
        # Without keys the kernel never reads keys_ptr (HAS_KEYS=False): any int64 tensor will do.
        _gumbel_argmax_kernel[(n, split)](
            logits,
            temp,
            keys if keys is not None else out,
            base_key or 0,
            out,
            vals,
            idxs,
            cnt,
            vocab,
            logits.stride(0),
            chunk,
            split,
            HAS_KEYS=keys is not None,
            BLOCK_V=_BLOCK_V,
            MAX_SPLIT=_MAX_SPLIT,
            num_warps=8,
        )
    except Exception as e:  # noqa: BLE001 - a failed first build: keep serving on the unfused path
        if _state["compiled"]:
            raise
        _state["broken"] = True
        logger.warning("one-pass sampling kernel unavailable (%s: %s); using the unfused sampler", type(e).__name__, e)
        return None
    _state["compiled"] = True
    return out
