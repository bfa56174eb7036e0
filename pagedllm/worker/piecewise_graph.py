"""Piecewise CUDA graphs for prefill and mixed steps (vLLM's piecewise mode, without torch.compile).

An eager step launches every kernel from Python: for an 8B Llama that is ~17 ms of host time per step on an
H100 host (benchmarks/NOTES.md, session 17), more than the ~13 ms the device needs for a 512-token prefill, so
a step that admits a new request runs at the host's pace and delays every running decode. Attention is the one
part whose launch depends on the batch's shape (requests, query lengths, splits); everything between two
attention calls depends only on the token count. So, for a ladder of padded token counts, the model's forward
is captured as one CUDA graph per stretch between attention calls, and a step replays them in order, running
each layer's attention eagerly in between on the step's own metadata.

How the capture splits: under `forward_context.set_split_hook`, every `Attention.forward` copies its q/k/v into
static buffers (inside the segment being captured), ends that segment's capture, records the call and begins the
next segment, returning a static output buffer that the next segment reads. The static buffers are shared by
every layer and every size (a layer's attention consumes them before the next segment runs); the segments of
all sizes share one memory pool, which is safe because they replay in capture order and never concurrently.
Padded rows carry token 0 at position 0: the attention sees only the step's real tokens (its metadata), so the
padded rows of the output buffer keep finite old values and nothing reads them.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pagedllm import envs
from pagedllm.forward_context import set_forward_context, set_split_hook
from pagedllm.logger import init_logger
from pagedllm.worker.async_output import Patch, apply_patch

logger = init_logger(__name__)


def piecewise_sizes(max_tokens: int) -> list[int]:
    """Padded token counts: every 64 up to 1,024 (at most 63 padded rows: <= 12% extra GEMM work at 512
    tokens), then every 256 up to 4,096, then every 512 (<= 12% again; 52 sizes up to 16,384)."""
    sizes = [s for s in range(64, min(max_tokens, 1024) + 1, 64)]
    sizes += [s for s in range(1280, min(max_tokens, 4096) + 1, 256)]
    sizes += [s for s in range(4608, max_tokens + 1, 512)]
    return sizes


HOST_S_PER_LAYER = 1e-3
"""Host time of an eager prefill step's launches per decoder layer (SmolLM2's shape, 30 layers, 16,384 tokens:
~30 ms on an H200 host, benchmarks/NOTES.md session 40)."""
PREFILL_FLOPS = 6e14
"""A 16-bit GEMM rate at prefill sizes (an H200 runs 8192^3 at ~790 TFLOP/s)."""


def matmul_weights(model: torch.nn.Module, vocab_size: int) -> int:
    """Weights a token multiplies in the decoder: the linear layers' logical input x output sizes (packed or
    quantized storage aside), or else every 2-D parameter but the vocabulary-sized ones (embedding, LM head:
    only a step's last tokens reach the output layer)."""
    from pagedllm.model_executor.layers.linear import LinearBase

    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    if linears:
        return sum(m.input_size * m.output_size for m in linears)
    return sum(p.numel() for p in model.parameters() if p.ndim == 2 and p.shape[0] != vocab_size)


def graph_tokens_for(model: torch.nn.Module, num_layers: int, vocab_size: int) -> int:
    """The default largest graphed prefill / mixed step: the token count up to which the step's GEMMs take less
    device time than launching it eagerly takes host time (2 FLOPs a weight a token), at least 2,048. A 135M
    model's 16,384-token steps are host-bound eagerly (~30 ms of launches for ~13 ms of kernels: S2's offline
    run 0.786 -> 0.577 s with them graphed); an 8B model's GEMMs outlast the launches from ~1,300 tokens on."""
    weights = matmul_weights(model, vocab_size)
    if not weights:
        return 2048
    return max(2048, int(num_layers * HOST_S_PER_LAYER * PREFILL_FLOPS / (2 * weights)))


def plain_dense_model(model: torch.nn.Module) -> bool:
    """Whether piecewise graphs apply: no mixture-of-experts block (its routing may need the host mid-forward
    at prefill sizes), every attention layer behind `Attention.forward` (the split point)."""
    names = {type(m).__name__.lower() for m in model.modules()}
    return not any("moe" in n or "expert" in n for n in names)


def mixed_graph_max_tokens(runner: Any) -> int:
    """The largest padded token count of a `ModelRunner`'s (typed Any: its module imports this one) graphs for
    prefill and mixed steps: min(PAGEDLLM_PIECEWISE_MAX_TOKENS, max_num_batched_tokens) (unset: by the model's
    size, `graph_tokens_for`; bigger steps are device-bound anyway), or 0 where they
    do not apply: LoRA and multimodal steps take the eager path's inputs, as does speculation whose proposer
    reads the target's hidden states (EAGLE: its hooks catch intermediate layers), pooling models, MoE models,
    and tensor parallelism (not yet measured). N-gram and draft-model speculation take them: a batch-1 request's
    prompt otherwise ran eagerly, ~10 ms of host launches for SmolLM2 (NOTES, session 22)."""
    cap = envs.PAGEDLLM_PIECEWISE_MAX_TOKENS
    if cap is None:
        mc = runner.model_config
        cap = graph_tokens_for(runner.model, mc.num_layers, mc.vocab_size)
    max_tokens = min(cap, runner.max_num_tokens)
    if (
        max_tokens < 64
        or runner.cuda_graphs is None
        or runner.lora is not None
        or (runner.spec is not None and runner.spec.config.method not in ("ngram", "draft_model"))
        or runner.mm is not None
        or runner.config.parallel_config.tensor_parallel_size > 1
        or runner.model_config.runner_type != "generate"
        or not plain_dense_model(runner.model)
    ):
        return 0
    return max_tokens


def capture_piecewise(runner: Any, max_tokens: int) -> PiecewiseGraphRunner | None:
    """A `ModelRunner`'s piecewise graphs up to `max_tokens` tokens, in the decode graphs' pool; None if the
    capture fails (the steps then run eagerly)."""
    pw = PiecewiseGraphRunner(runner.model, piecewise_sizes(max_tokens), runner.device, runner.cuda_graphs.pool)
    try:
        pw.capture()
    except Exception as e:  # a model whose forward cannot be captured still serves, eagerly
        torch.cuda.synchronize(runner.device)
        logger.warning(
            "Piecewise CUDA graphs off: capture failed (%s: %s); prefill steps run eagerly", type(e).__name__, e
        )
        return None
    return pw


@dataclass
class _Segments:
    """One padded size: graphs[i] runs up to attention call i, the last graph to the model's output."""

    graphs: list[torch.cuda.CUDAGraph] = field(default_factory=list)
    calls: list[tuple[Any, tuple[torch.Tensor, ...], Any]] = field(default_factory=list)
    """(attention layer, its q / k / v / output static buffers cut to this size, its RotaryArgs) per call."""
    out: torch.Tensor | None = None


class PiecewiseGraphRunner:
    def __init__(self, model: torch.nn.Module, sizes: list[int], device: torch.device, pool: Any = None) -> None:
        self.model = model
        self.sizes = sizes
        self.max_size = sizes[-1]
        self.device = device
        self.pool = pool
        cap = self.max_size
        self._header = torch.zeros(2 * cap, dtype=torch.long, device=device)
        self._header_host = np.zeros(2 * cap, dtype=np.int64)
        self.input_ids, self.positions = self._header[:cap], self._header[cap:]
        self._bufs: dict[tuple[int, int, int, torch.dtype], tuple[torch.Tensor, ...]] = {}
        """(q, k, v widths, dtype) -> static q, k, v and output buffers [max_size, width]."""
        self.segments: dict[int, _Segments] = {}
        self._capturing: _Segments | None = None
        self.num_runs = 0
        """Steps run through these graphs (tests and stats)."""

    def can_run(self, num_tokens: int) -> bool:
        return num_tokens <= self.max_size

    # ---- capture -------------------------------------------------------------------------------------
    def _split(self, layer: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rotary: Any) -> torch.Tensor:
        """The split hook: q/k/v into the static buffers; while capturing, end this segment and begin the next."""
        key = (q.shape[1], k.shape[1], v.shape[1], q.dtype)
        bufs = self._bufs.get(key)
        if bufs is None:
            assert self._capturing is None, "static buffers are made in the warm-up forward"
            bufs = tuple(torch.zeros(self.max_size, w, dtype=q.dtype, device=self.device) for w in (*key[:3], key[0]))
            self._bufs[key] = bufs
        t = q.shape[0]
        for buf, src in zip(bufs, (q, k, v)):
            buf[:t].copy_(src)
        seg = self._capturing
        if seg is not None:
            seg.graphs[-1].capture_end()
            if self.pool is None:
                self.pool = seg.graphs[-1].pool()
            seg.calls.append((layer, tuple(b[:t] for b in bufs), rotary))
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=self.pool)
            seg.graphs.append(graph)
        return bufs[3][:t]

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        stream = torch.cuda.Stream(self.device)
        for size in reversed(self.sizes):  # largest first: the smaller sizes reuse its pool memory
            ids, pos = self.input_ids[:size], self.positions[:size]
            with set_split_hook(self._split):
                self.model(ids, pos)  # warm-up: compiles the kernels of this size, makes the static buffers
            torch.cuda.synchronize(self.device)
            seg = _Segments()
            self._capturing = seg
            stream.wait_stream(torch.cuda.current_stream(self.device))
            try:
                with torch.cuda.stream(stream), set_split_hook(self._split):
                    graph = torch.cuda.CUDAGraph()
                    graph.capture_begin(pool=self.pool)
                    seg.graphs.append(graph)
                    try:
                        seg.out = self.model(ids, pos)
                    finally:
                        seg.graphs[-1].capture_end()
                if self.pool is None:
                    self.pool = seg.graphs[-1].pool()
            finally:
                self._capturing = None
            torch.cuda.current_stream(self.device).wait_stream(stream)
            self.segments[size] = seg
        torch.cuda.synchronize(self.device)
        n_graphs = sum(len(s.graphs) for s in self.segments.values())
        logger.info(
            "Captured piecewise CUDA graphs for %d token counts (64..%d), %d graphs, in %.2f s",
            len(self.sizes),
            self.max_size,
            n_graphs,
            time.perf_counter() - t0,
        )

    # ---- one step ------------------------------------------------------------------------------------
    def run(
        self, input_ids: np.ndarray, positions: np.ndarray, patch: Patch | None, attn_metadata: dict[str, Any]
    ) -> torch.Tensor:
        """The hidden states of a step's len(input_ids) tokens: the segments of the next captured size replayed
        in order, each attention run eagerly on `attn_metadata` (the step's, over its real tokens) in between.
        `patch` (token indices, ids on the device) overrides ids still in flight (async scheduling)."""
        n = len(input_ids)
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        cap = self.max_size
        host = self._header_host
        host[:n] = input_ids
        host[n:size] = 0
        host[cap : cap + n] = positions
        host[cap + n : cap + size] = 0
        # One upload (from pageable memory: the host mirror may be rewritten as soon as copy_ returns).
        self._header.copy_(torch.from_numpy(host), non_blocking=True)
        if patch is not None:
            apply_patch(self.input_ids, patch)
        seg = self.segments[size]
        with set_forward_context(attn_metadata):
            for graph, (layer, (q, k, v, out), rotary) in zip(seg.graphs, seg.calls):
                graph.replay()
                layer.attend(q, k, v, rotary, out)
            seg.graphs[-1].replay()
        self.num_runs += 1
        assert seg.out is not None
        return seg.out[:n]
