"""The model runner's multimodal step: run the vision encoder on the images the scheduler named, keep the
outputs by image hash, and give the step's input embeddings their image rows (a chunk that starts or
ends inside an image takes the matching slice of the cached output)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.multimodal.inputs import overlapping


@dataclass
class MMStep:
    pieces: list[tuple[int, torch.Tensor]] | None
    """(flat token index, encoder rows) to write into the input embeddings; None: no image token this step."""
    positions: np.ndarray | None
    """M-RoPE models: [3, T] positions, or [T] when every token is past its prompt (a CUDA graph can run)."""
    key_limit: np.ndarray | None = None
    """Models whose image tokens attend to each other (`requires_whole_mm_items`), when a step's token is inside
    an image: [T] int32, the last key position each token may see (its image's last position, else its own)."""


class MultiModalRunner:
    def __init__(self, model: Any, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.mrope = bool(getattr(model, "uses_mrope", False))
        self.bidirectional = bool(getattr(model, "requires_whole_mm_items", False))
        self._mrope: dict[str, tuple[np.ndarray, int]] = {}
        """Request id -> its prompt's M-RoPE positions [3, prompt_len] and the offset of later positions."""
        self._memo: tuple[list[str], np.ndarray, np.ndarray, bool] | None = None
        """(scheduled request ids, their offsets, their prompt-table lengths, any image request) of the last step."""
        self._ends_memo: tuple[list[str], np.ndarray] | None = None
        """(scheduled request ids, where each one's last image ends) of the last step."""
        self.outputs: dict[str, torch.Tensor] = {}
        """Image hash -> encoder output [placeholder tokens, hidden] on the device."""
        self.encoder_seconds = 0.0
        """Wall time spent in the encoder (synchronized on the device); the benchmark's encoder share."""
        self.time_encoder = False

    def prepare(self, so: SchedulerOutput, x: Any, requests: dict[str, Any]) -> MMStep | None:
        """Encodes this step's images; the image rows for the input embeddings and (M-RoPE) the positions.
        None when neither is needed (the plain forward runs)."""
        if self.mrope and so.finished_req_ids:
            for rid in so.finished_req_ids:
                self._mrope.pop(rid, None)
        pieces = self._pieces(so, x, requests)
        positions = self._mrope_positions(x, requests) if self.mrope else None
        if pieces is None and positions is None:
            return None
        limit = self._key_limits(x, requests) if self.bidirectional and pieces is not None else None
        return MMStep(pieces, positions, limit)

    def _key_limits(self, x: Any, requests: dict[str, Any]) -> np.ndarray | None:
        """Per token, the last key position it may see: causal, except that an image's tokens see the whole
        image (the scheduler keeps each image within one step, so those keys are written this step)."""
        assert self._ends_memo is not None  # set by _pieces this step
        limit: np.ndarray | None = None
        for i in np.nonzero(x.computed < self._ends_memo[1])[0].tolist():
            start = int(x.computed[i])
            end = start + int(x.num_scheduled[i])
            base = int(x.cu[i])
            for _, f in overlapping(requests[x.req_ids[i]].mm_features, start, end):
                if f.length < 2:
                    continue
                if limit is None:
                    limit = x.positions.astype(np.int32)
                lo, hi = max(start, f.offset), min(end, f.offset + f.length)
                limit[base + lo - start : base + hi - start] = f.offset + f.length - 1
        return limit

    def _mrope_positions(self, x: Any, requests: dict[str, Any]) -> np.ndarray | None:
        """[3, T] M-RoPE positions, or [T] when no token is inside an image prompt's range (the common decode
        step: each token's position + its request's offset, vectorized; the per-request lists are rebuilt only
        when the scheduled requests change)."""
        memo = self._memo
        if memo is None or memo[0] != x.req_ids:
            n = len(x.req_ids)
            deltas, plens = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
            for i, rid in enumerate(x.req_ids):
                st = requests[rid]
                if st.mm_features:  # (text-only requests: delta 0, no prompt table)
                    info = self._mrope.get(rid)
                    if info is None:
                        info = self._mrope[rid] = self.model.get_mrope_positions(
                            len(st.prompt_token_ids), st.mm_features
                        )
                    plens[i], deltas[i] = info[0].shape[1], info[1]
            memo = self._memo = (list(x.req_ids), deltas, plens, bool(plens.any()))
        _, deltas, plens, any_mm = memo
        if not any_mm:
            return None
        tok_req = x.req_of_token
        shifted = x.positions + deltas[tok_req]
        inside = x.positions < plens[tok_req]
        if not inside.any():
            return shifted
        out = np.tile(shifted, (3, 1))
        for i in np.unique(tok_req[inside]).tolist():
            a, b = int(x.cu[i]), int(x.cu[i + 1])
            p = x.positions[a:b]
            ins = p < plens[i]
            seg = out[:, a:b]
            seg[:, ins] = self._mrope[x.req_ids[i]][0][:, p[ins]]
        return out

    def _pieces(self, so: SchedulerOutput, x: Any, requests: dict[str, Any]) -> list[tuple[int, torch.Tensor]] | None:
        for h in so.free_encoder_hashes:
            self.outputs.pop(h, None)
        if so.scheduled_encoder_inputs:
            self._encode(so.scheduled_encoder_inputs, requests)
        memo = self._ends_memo
        if memo is None or memo[0] != x.req_ids:
            ends = np.fromiter(
                ((f[-1].offset + f[-1].length) if (f := requests[r].mm_features) else 0 for r in x.req_ids),
                dtype=np.int64,
                count=len(x.req_ids),
            )
            memo = self._ends_memo = (list(x.req_ids), ends)
        pieces: list[tuple[int, torch.Tensor]] = []
        # Only requests whose computed tokens have not passed their last image can meet one (decodes never).
        for i in np.nonzero(x.computed < memo[1])[0].tolist():
            rid = x.req_ids[i]
            feats = requests[rid].mm_features
            start = int(x.computed[i])
            end = start + int(x.num_scheduled[i])
            base = int(x.cu[i])
            for _, f in overlapping(feats, start, end):
                lo, hi = max(start, f.offset), min(end, f.offset + f.length)
                out = self.outputs.get(f.identifier)
                if out is None:
                    raise RuntimeError(f"encoder output of image {f.identifier[:12]} missing (request {rid})")
                pieces.append((base + lo - start, out[lo - f.offset : hi - f.offset]))
        return pieces or None

    @torch.inference_mode()
    def _encode(self, scheduled: dict[str, list[int]], requests: dict[str, Any]) -> None:
        feats = []
        seen: set[str] = set()
        for rid, idxs in scheduled.items():
            for j in idxs:
                f = requests[rid].mm_features[j]
                if f.identifier not in seen and f.identifier not in self.outputs:
                    seen.add(f.identifier)
                    feats.append(f)
        if not feats:
            return
        timing = self.time_encoder
        if timing:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            t0 = time.perf_counter()
        items = [{k: v.to(self.device, non_blocking=True) for k, v in f.tensors().items()} for f in feats]
        outs = self.model.embed_multimodal(items)
        for f, out in zip(feats, outs):
            if out.shape[0] != f.length:
                raise RuntimeError(f"encoder returned {out.shape[0]} rows for an image of {f.length} placeholders")
            self.outputs[f.identifier] = out
        if timing:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.encoder_seconds += time.perf_counter() - t0

    @torch.inference_mode()
    def profile(self, num_tokens: int) -> None:
        """The encoder over dummy images filling one step's encoder budget (`num_tokens` placeholder rows):
        its activations count in the profiled peak memory the KV cache is sized from."""
        items = self.model.dummy_mm_items(num_tokens)
        self.model.embed_multimodal([{k: v.to(self.device) for k, v in it.items()} for it in items])

    def embeds(self, input_ids: torch.Tensor, pieces: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
        emb = self.model.embed_input_ids(input_ids)
        for pos, rows in pieces:
            emb[pos : pos + rows.shape[0]] = rows.to(emb.dtype)
        return emb
