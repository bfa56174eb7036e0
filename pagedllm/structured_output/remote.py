"""Structured outputs with the grammar work in the grammar server process (`server.py`), opt-in:
PAGEDLLM_GRAMMAR_PROCESS=1.

The step loop's part: when the scheduler schedules a step with constrained requests (`prepare`), one message
orders its mask from the server (after the previous mask's sampled ids). The runner does not wait for the mask:
on a CUDA engine it enqueues a stream wait on the server's flag, the mask's upload and apply, the sampling, and
then the sampled ids' copy back into shared memory and the flag the server waits on (`host_flags.py`), all with
the forward, so the device queue runs ahead as in a plain step and the fill runs while the forward does. A CPU
engine waits for the flag on the host.

The loop never waits for the intake either: a token the mask allowed is never rejected, and it ends a grammar
exactly when it is one of the grammar's stop tokens, so the scheduler learns a grammar's end without asking
(`begin_update`). Tokens not taken that way (reasoning, a resumed request) go through a blocking feed."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING, Any

import numpy as np

from pagedllm.structured_output.apply import apply_rows_cpu, launch_mask_kernel, upload_row_map
from pagedllm.structured_output.backend import GrammarKey, grammar_key
from pagedllm.structured_output.config import StructuredOutputsConfig
from pagedllm.structured_output.manager import GrammarRejectedError, StructuredOutputManager
from pagedllm.structured_output.matchers import RequestGrammar
from pagedllm.structured_output.server import MASKS, TOKENS, GrammarClient, ServerSpec

if TYPE_CHECKING:
    import torch

    from pagedllm.core.request import Request
    from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
    from pagedllm.executor.abstract import StepFuture
    from pagedllm.reasoning import ReasoningParser

_REMOTE = object()
"""`RequestGrammar.matcher` of a request whose matcher lives in the server."""


class ServerMask:
    """Step mask number `k`, filled by the server into its ring slot (rows: `rids`, in order). The runner calls
    `apply_to` and, after sampling, `publish_sampled`."""

    defer_sampling = False
    """The runner launches the sampling with the forward (the wait for the mask is on the device)."""

    def __init__(self, mgr: ProcessGrammarManager, k: int, row_of_rid: dict[str, int]) -> None:
        self._mgr = mgr
        self.k = k
        self.row_of_rid = row_of_rid
        self.rids = list(row_of_rid)
        self.published = False
        """Its sampled ids went to the server (the server takes them; `begin_update` counts them seen)."""
        self._logit_of_row: np.ndarray | None = None
        """Mask row -> its logits row (-1: not sampled); None: row i is logits row i."""
        self._map_dev: torch.Tensor | None = None

    def apply_to(self, logits: torch.Tensor, req_ids: Sequence[str], sample_idx: np.ndarray) -> None:
        """Mask the sampled rows' logits: on the device after a stream wait for the fill (CUDA), or once the
        host saw the fill (CPU)."""
        mgr, m, k = self._mgr, len(self.rids), self.k
        row_of = self.row_of_rid
        logit_of_row = np.full(m, -1, dtype=np.int64)
        for j, i in enumerate(sample_idx.tolist()):
            r = row_of.get(req_ids[i])
            if r is not None and r < m:
                logit_of_row[r] = j
        identity = logits.shape[0] >= m and bool((logit_of_row == np.arange(m)).all())
        self._logit_of_row = None if identity else logit_of_row
        vocab = min(logits.shape[-1], mgr.valid_vocab)
        if logits.is_cuda:
            import torch

            flags = mgr.host_mem
            assert flags is not None
            flags.wait_geq(mgr.flag_address(MASKS), k)
            dev = mgr.device_mask(logits.device, m)
            dev.copy_(mgr.mask_views[k % mgr.depth][:m], non_blocking=True)
            rows = None if identity else upload_row_map(logits.device, logit_of_row)
            self._map_dev = rows
            launch_mask_kernel(logits, dev, rows, vocab)
            del torch
            return
        if not mgr.client.wait_mask(k):
            mgr.fail_all(self.rids, "structured_outputs: the grammar server did not fill a step's mask in time")
            return
        mask = mgr.mask_views[k % mgr.depth]
        kept = [(int(j), r) for r, j in enumerate(logit_of_row.tolist()) if j >= 0]
        apply_rows_cpu(logits, mask, [j for j, _ in kept], [r for _, r in kept], vocab, None)

    def publish_sampled(self, sampled: torch.Tensor) -> None:
        """This step's sampled ids of the mask's rows to the server (int64 [n], the logits' rows)."""
        mgr, m, k = self._mgr, len(self.rids), self.k
        if sampled.is_cuda:
            import torch

            if self._logit_of_row is None:
                ids = sampled[:m]
            elif self._map_dev is not None and (self._logit_of_row >= 0).all():
                ids = sampled.index_select(0, self._map_dev[:m])
            else:  # rows the runner did not sample: -1
                src = torch.from_numpy(self._logit_of_row).to(sampled.device, non_blocking=True)
                ids = torch.where(src >= 0, sampled.index_select(0, src.clamp(min=0)), -1)
            mgr.token_views[k % mgr.depth][:m].copy_(ids.to(torch.int32), non_blocking=True)
            assert mgr.host_mem is not None
            mgr.host_mem.write(mgr.flag_address(TOKENS), k)
        else:
            got = sampled.tolist()
            lor = self._logit_of_row
            ids_host = got[:m] if lor is None else [got[j] if j >= 0 else -1 for j in lor.tolist()]
            mgr.client.publish(k, ids_host)
        self.published = True
        mgr.published(k)

    # A runner that asks for the mask on the host (no `apply_to`): the multiprocess executor does not use this
    # manager (`engine.make_structured_output_manager`).


class ProcessGrammarManager(StructuredOutputManager):
    def __init__(
        self,
        config: StructuredOutputsConfig,
        spec: ServerSpec,
        vocab_size: int,
        valid_vocab: int,
        stop_token_ids: Sequence[int],
        reasoning_parser_factory: Callable[[], ReasoningParser] | None = None,
        cuda: bool = False,
    ) -> None:
        super().__init__(config, _no_backend, vocab_size, reasoning_parser_factory)
        import torch

        self.valid_vocab = valid_vocab
        self.stop_ids = frozenset(stop_token_ids)
        self.client = GrammarClient(spec)
        self.depth = spec.depth
        rings = self.client.rings
        self.mask_views = [torch.from_numpy(rings.masks[i]) for i in range(spec.depth)]
        self.token_views = [torch.from_numpy(rings.tokens[i]) for i in range(spec.depth)]
        self.host_mem = None
        if cuda:  # the segment as pinned, mapped memory: true async copies, and flags the stream waits on / writes
            from pagedllm.structured_output.host_flags import RegisteredHostMemory

            buf = rings.flags
            self.host_mem = RegisteredHostMemory(buf.ctypes.data, self.client._shm.size)
            self._watchdog = threading.Thread(target=self._watch, name="grammar-watchdog", daemon=True)
            self._watchdog.start()
        self._device_masks: dict[Any, torch.Tensor] = {}
        self._keys: dict[str, GrammarKey] = {}
        self._asked: set[GrammarKey] = set()
        self._k = 0
        """The number of the last mask ordered."""
        self._untaken: int | None = None
        """The last mask whose sampled ids were published and not yet ordered taken."""
        self._taking: frozenset[int] = frozenset()
        self._closed = threading.Event()
        self.step_worker = False

    # ---- shared memory -------------------------------------------------------------------------------
    def flag_address(self, index: int) -> int:
        return int(self.client.rings.flags.ctypes.data) + 4 * index

    def device_mask(self, device: Any, m: int) -> torch.Tensor:
        import torch

        buf = self._device_masks.get(device)
        if buf is None:
            buf = torch.empty((self.client.spec.rows, self.client.spec.words), dtype=torch.int32, device=device)
            self._device_masks[device] = buf
        return buf[:m]

    def published(self, k: int) -> None:
        self._untaken = k

    def _watch(self) -> None:
        """A dead server would leave the device waiting on its flag forever: release every wait and fail the
        structured requests instead."""
        while not self._closed.wait(1.0):
            if not self.client.alive:
                self.client.rings.flags[MASKS] = (self._k + (1 << 20)) & 0x7FFFFFFF
                self._server_dead = True
                return

    _server_dead = False

    def fail_all(self, rids: Sequence[str], error: str) -> None:
        for rid in rids:
            st = self.states.get(rid)
            if st is not None and st.error is None:
                st.error = error

    # ---- compile -------------------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        params = req.sampling_params.structured_outputs
        assert params is not None
        key = grammar_key(params, self.config)
        if key not in self._asked or self.client.compiled.get(key, None) is not None:
            self.client.compiled.pop(key, None)
            self.client.compile(key, params)
            self._asked.add(key)
        self._keys[req.request_id] = key
        ended = self._reasoning_factory is None or self.config.enable_in_reasoning
        self.states[req.request_id] = RequestGrammar(None, ended)  # type: ignore[arg-type]

    def poll(self, req: Request) -> bool | str:
        st = self.states[req.request_id]
        if st.matcher is not None:
            return True
        if self._server_dead:
            return "structured_outputs: the grammar server process died"
        self.client.poll()
        key = self._keys[req.request_id]
        if key not in self.client.compiled:
            return False
        err = self.client.compiled[key]
        if err is not None:
            return f"structured_outputs: the grammar failed to compile: {err}"
        self.client.open(req.request_id, key, req.output_token_ids)
        st.matcher = _REMOTE  # type: ignore[assignment]
        st.stop_ids = self.stop_ids
        st.num_seen = len(req.output_token_ids)
        if st.reasoning_ended:
            self._active[req.request_id] = st
        return True

    def wait_pending(self, timeout: float) -> None:
        self.client.poll(timeout)

    def warm_up(self) -> Any:
        return None

    # ---- one step ------------------------------------------------------------------------------------
    def prepare(self, so: SchedulerOutput, requests: dict[str, Request]) -> None:
        ids: dict[str, int] = {}
        done: list[str] = []
        scheduled = so.num_scheduled_tokens
        for rid, st in self._active.items():
            if st.terminated or st.error is not None:
                done.append(rid)
                continue
            req = requests.get(rid)
            if rid not in scheduled or req is None or req.num_computed_tokens < req.num_tokens:
                continue
            ids[rid] = len(ids)
        for rid in done:
            del self._active[rid]
        if ids:
            self._k = k = (self._k + 1) & 0x7FFFFFFF or 1
            self.client.step(k, list(ids), self._untaken)
            self._untaken = None
            so.structured_output_request_ids = ids
            so.grammar_bitmask = ServerMask(self, k, ids)  # type: ignore[assignment]

    def begin_update(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> None:
        """(Scheduler, before the step's tokens join their requests) the tokens sampled under the step's mask are
        the server's (`taking`); a stop token the mask allowed ends its grammar: the state says so before the
        scheduler looks. Failures the server reported mark their requests."""
        client = self.client
        client.poll()
        if client.failed:
            failed, client.failed = client.failed, {}
            for rid, err in failed.items():
                self.fail_all([rid], err)
        mask = sched.grammar_bitmask
        if not isinstance(mask, ServerMask) or not mask.published:
            self._taking = frozenset()
            return
        rows = mask.row_of_rid
        taken: list[int] = []
        active = self._active
        bad = result.failed
        for rid, toks in zip(result.req_ids, result.sampled_token_ids):
            st = active.get(rid)
            if st is None or len(toks) != 1 or rid not in rows or (bad and rid in bad):
                continue
            taken.append(id(st))
            st.num_seen += 1
            if toks[0] in st.stop_ids:
                st.terminated = True
        self._taking = frozenset(taken)

    def taking(self) -> AbstractSet[int]:
        return self._taking

    def chain(self, so: SchedulerOutput, previous: StepFuture) -> StepFuture:
        return previous

    def accept(self, req: Request, new_tokens: Sequence[int]) -> bool:
        st = self.states.get(req.request_id)
        if st is None or st.matcher is None:
            return False
        if st.error is not None:
            raise GrammarRejectedError(st.error)
        n_out = len(req.output_token_ids)
        if st.num_seen >= n_out:  # taken by the server (which also set an allowed stop token's end)
            return st.terminated
        skip = st.num_seen - (n_out - len(new_tokens))
        fresh = list(new_tokens[skip:] if skip > 0 else new_tokens)
        st.num_seen = n_out
        if st.terminated:
            return True
        if not st.reasoning_ended:
            if self._reasoning().is_reasoning_end(req.output_token_ids):
                st.reasoning_ended = True
                self._active[req.request_id] = st
            return False
        if self._untaken is not None:  # the ids the server has not taken come first
            self.client.take(self._untaken)
            self._untaken = None
        err, ended = self.client.feed(req.request_id, fresh)
        if err is not None:
            st.error = err
            raise GrammarRejectedError(err)
        st.terminated = ended
        return ended

    def remove(self, request_id: str) -> None:
        if request_id in self.states and self.states[request_id].matcher is not None:
            self.client.remove(request_id)
        self._keys.pop(request_id, None)
        super().remove(request_id)

    def shutdown(self) -> None:
        self._closed.set()
        super().shutdown()
        if self.host_mem is not None:
            self.host_mem.unregister()
        self.client.close()


def _no_backend() -> Any:
    raise RuntimeError("the grammar server process compiles; this process has no backend")
