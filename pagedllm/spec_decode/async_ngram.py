"""N-gram speculation with async scheduling: step N+1 is scheduled and launched while step N (a verification)
still runs, as plain decoding does, so the host's scheduling, input building and output processing hide
behind the device instead of adding to every step.

What the host cannot know when it launches N+1 is how many of N's proposals the target accepted. So:
- the scheduler counts each in-flight verification as one token (its `num_computed_tokens` is a lower bound
  until N's result is read, then grows by the accepted count) and reserves KV slots for the rest; every
  decoding request is scheduled with its k proposal rows as placeholders (`[-1] * k`);
- the device keeps each request's tokens (`DeviceHistory`): N's emitted tokens are appended there by N itself,
  the proposals for N+1 are found there (`device_ngram`), and N+1's decode rows read their input ids, positions,
  sequence lengths and KV slots from there (`fixup_graph_inputs` rewrites the verification graph's inputs on the
  device after the host's upload; an eager step reads them back to the host first, which waits for N);
- N's emitted tokens come back through a non-blocking copy (`SpecPending`), read when the engine collects N.

A step that must run synchronously (a request wants logprobs, penalties, ...) takes the synchronous path with
the placeholders resolved from the device (`resolve_drafts`), and writes its tokens back to the history."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.sample.rejection_sampler import VerifyOutput, greedy_verify
from pagedllm.spec_decode.device_ngram import ngram_propose_device
from pagedllm.worker.input_batch import CachedRequestState
from pagedllm.worker.step_inputs import StepInputs


class DeviceHistory:
    """Per request (a slot each): its known tokens, their count, and its proposals for the next step, on the
    device. Slots are taken when a request enters the batch and given back when it leaves."""

    def __init__(self, max_reqs: int, max_model_len: int, k: int, n_min: int, n_max: int, device: torch.device) -> None:
        self.k, self.n_min, self.n_max = k, n_min, n_max
        self.device = device
        self.width = max_model_len + 2 * (k + 1)
        """Room past max_model_len for a verification's k + 1 writes beyond a request's known tokens."""
        self.hist = torch.zeros(max_reqs, self.width, dtype=torch.int32, device=device)
        self.lens = torch.zeros(max_reqs, dtype=torch.long, device=device)
        self.drafts = torch.zeros(max_reqs, max(k, 1), dtype=torch.long, device=device)
        self.num_real = torch.zeros(max_reqs, dtype=torch.long, device=device)
        self.slot_of: dict[str, int] = {}
        self._free = list(range(max_reqs - 1, -1, -1))

    def add(self, st: CachedRequestState) -> None:
        """Upload a request's known tokens (a new request, or one resumed after preemption)."""
        slot = self.slot_of.get(st.req_id)
        if slot is None:
            slot = self.slot_of[st.req_id] = self._free.pop()
        toks = np.asarray(st.prompt_token_ids + st.output_token_ids, dtype=np.int32)
        self.hist[slot, : len(toks)].copy_(torch.from_numpy(toks), non_blocking=True)
        self.lens[slot] = len(toks)
        self.num_real[slot] = 0

    def drop(self, req_id: str) -> None:
        slot = self.slot_of.pop(req_id, None)
        if slot is not None:
            self._free.append(slot)

    def slots(self, req_ids: list[str]) -> np.ndarray:
        return np.fromiter((self.slot_of[r] for r in req_ids), dtype=np.int64, count=len(req_ids))

    def draft_ids(self, slots: np.ndarray, num_drafts: np.ndarray) -> torch.Tensor:
        """The first num_drafts[b] proposals of slot slots[b], flat, on the device."""
        k = self.drafts.shape[1]
        within = np.arange(int(num_drafts.sum())) - np.repeat(np.cumsum(num_drafts) - num_drafts, num_drafts)
        flat = np.repeat(slots * k, num_drafts) + within
        return self.drafts.view(-1)[torch.from_numpy(flat).to(self.device, non_blocking=True)]

    def advance(
        self,
        slots: torch.Tensor,
        num_drafts: torch.Tensor,
        starts: torch.Tensor | None,
        host: tuple[np.ndarray, np.ndarray],
        bound: int,
        argmax: torch.Tensor | None = None,
        verified: VerifyOutput | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """After a step's forward, per sampling request b: the greedy verdict of its num_drafts[b] proposals
        against its rows' `argmax` (rows from starts[b]), or a rejection sampler's `verified` output; the emitted
        tokens join its history and its next proposals are found. Returns (emitted tokens [B, K + 1], -1
        padded; their count; how many of the verified proposals were real). `host`: (slots, num_drafts) on the
        host; `bound`: an upper bound of the new lengths. On CUDA: one Triton launch (`triton_ngram`)."""
        if self.device.type == "cuda":
            from pagedllm.spec_decode.triton_ngram import verify_append_propose

            if argmax is not None:
                return verify_append_propose(self, slots, num_drafts, starts, argmax)
            assert verified is not None
            tok = verified.token_ids
            if tok.shape[1] < self.k + 1:
                tok = torch.nn.functional.pad(tok, (0, self.k + 1 - tok.shape[1]), value=-1)
            return verify_append_propose(self, slots, num_drafts, None, None, tok.contiguous(), verified.num_emitted)
        if argmax is not None:
            verified = greedy_verify(argmax, self.draft_ids(*host), host[1])
        assert verified is not None
        real = torch.minimum(self.num_real[slots], num_drafts)
        self.append_and_propose(slots, verified.token_ids, verified.num_emitted, bound)
        return verified.token_ids, verified.num_emitted, real

    def append_and_propose(self, slots: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor, bound: int) -> None:
        """After a verification: tokens [B, K + 1] (the first counts[b] emitted by request b, then -1) join the
        requests' histories, and each gets its proposals for the next step. `bound`: a host upper bound of the
        new lengths."""
        n = tokens.shape[1]
        cols = self.lens[slots].unsqueeze(1) + torch.arange(n, device=self.device).unsqueeze(0)
        self.hist[slots.unsqueeze(1), cols.clamp(max=self.width - 1)] = tokens.to(torch.int32)
        lens = self.lens[slots] + counts
        self.lens[slots] = lens
        if self.k:
            props, real = ngram_propose_device(
                self.hist[slots], lens, self.n_min, self.n_max, self.k, min(bound, self.width)
            )
            self.drafts[slots] = props
            self.num_real[slots] = real


@dataclass
class DecodeRows:
    """The step's decoding requests (those with placeholder proposals), as indices into the step's requests."""

    idx: np.ndarray
    slots: np.ndarray
    num_drafts: np.ndarray


def decode_rows(x: StepInputs, spec: dict[str, list[int]], history: DeviceHistory) -> DecodeRows:
    idx = np.fromiter((i for i, r in enumerate(x.req_ids) if r in spec), dtype=np.int64)
    ids = [x.req_ids[i] for i in idx.tolist()]
    nd = np.fromiter((len(spec[r]) for r in ids), dtype=np.int64, count=len(ids))
    return DecodeRows(idx, history.slots(ids), nd)


def resolve_on_host(x: StepInputs, dec: DecodeRows, history: DeviceHistory) -> None:
    """The decode rows' ids, positions and lengths read back from the device into `x` (an eager step: this
    waits for the step in flight)."""
    if not len(dec.idx):
        return
    s = torch.from_numpy(dec.slots).to(history.device)
    lens = history.lens[s]
    last = history.hist[s, lens - 1]
    lens_h, last_h, drafts_h = lens.cpu().numpy(), last.cpu().numpy(), history.drafts[s].cpu().numpy()
    for j, i in enumerate(dec.idx.tolist()):
        base = int(lens_h[j]) - 1
        nd = int(dec.num_drafts[j])
        lo = int(x.cu[i])
        x.positions[lo : lo + nd + 1] = base + np.arange(nd + 1)
        x.input_ids[lo] = last_h[j]
        x.input_ids[lo + 1 : lo + 1 + nd] = drafts_h[j, :nd]
        x.computed[i] = base
        x.seq_lens[i] = base + 1 + nd


def resolve_drafts(spec: dict[str, list[int]], history: DeviceHistory) -> tuple[dict[str, list[int]], dict[str, int]]:
    """A synchronous step's placeholder proposals replaced by the device's (and each request's count of real
    ones), read back to the host."""
    ids = [r for r, d in spec.items() if d]
    if not ids:
        return spec, {}
    s = torch.from_numpy(history.slots(ids)).to(history.device)
    drafts, real = history.drafts[s].cpu().numpy(), history.num_real[s].cpu().numpy()
    out = dict(spec)
    for j, r in enumerate(ids):
        out[r] = drafts[j, : len(spec[r])].tolist()
    return out, {r: int(real[j]) for j, r in enumerate(ids)}


def fixup_graph_inputs(
    graphs: object,
    history: DeviceHistory,
    slots: torch.Tensor,
    num_drafts: torch.Tensor,
    block_sizes: list[int],
    max_model_len: int,
) -> None:
    """A verification graph's inputs for n decode requests (every request of the step, in order), rewritten on
    the device after the host's upload: row j of request i is its (j)th token after its last known one minus
    one, i.e. position lens - 1 + j, input id its last token (j = 0) or proposal j - 1; its sequence length
    counts all q rows (as `run_padded` lays them out); each row's KV slot from the uploaded block table, -1
    for rows past its proposals or past max_model_len."""
    g = graphs  # worker.cuda_graph.CudaGraphRunner
    n, q = int(slots.shape[0]), g.q  # type: ignore[attr-defined]
    ar = torch.arange(q, device=slots.device)
    base = history.lens[slots] - 1
    pos = base.unsqueeze(1) + ar.unsqueeze(0)
    g.positions[: n * q].view(n, q).copy_(pos)  # type: ignore[attr-defined]
    ids = g.input_ids[: n * q].view(n, q)  # type: ignore[attr-defined]
    ids[:, 0] = history.hist[slots, base].long()
    if q > 1:
        ids[:, 1:] = history.drafts[slots, : q - 1]
    g.seq_lens[:n].copy_(base + q)  # type: ignore[attr-defined]
    valid = (ar.unsqueeze(0) <= num_drafts.unsqueeze(1)) & (pos < max_model_len)
    p = pos.clamp(max=max_model_len - 1)
    for table, sl, bs in zip(g.block_tables, g.slots, block_sizes):  # type: ignore[attr-defined]
        blk = table[:n].gather(1, torch.div(p, bs, rounding_mode="floor")).long()
        sl[: n * q].view(n, q).copy_(torch.where(valid, blk * bs + p % bs, torch.full_like(p, -1)))


@dataclass
class SpecPending:
    """A launched verification step: its emitted tokens come back through a non-blocking copy."""

    req_ids: list[str]
    sample_idx: np.ndarray
    result: torch.Tensor | None = None
    """Host (pinned) [B, K + 3] per sampled request: its emitted tokens (K + 1 columns, -1 after its last),
    their count, and its real proposals among this step's (0 for a prefill's first token)."""
    event: torch.cuda.Event | None = None
    prompt_logprobs_done: dict | None = None

    def wait(self) -> np.ndarray:
        if self.event is not None:
            self.event.synchronize()
        assert self.result is not None
        return self.result.numpy()


def pack(tokens: torch.Tensor, counts: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    return torch.cat([tokens, counts.unsqueeze(1), real.unsqueeze(1)], dim=1)
