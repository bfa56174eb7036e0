"""Structured outputs with the grammar work in the grammar server process (`server.py`), opt-in:
PAGEDLLM_GRAMMAR_PROCESS=1 (branch work: not yet measured on a GPU).

The step loop's part: when the scheduler reads step N's result (`begin_update`), the sampled tokens of the
constrained requests go to the server in one message, followed by the fill order of step N+1's mask when N+1 was
already scheduled (async scheduling); otherwise the fill is ordered when the runner asks for the mask. The server
answers with the mask in a shared-memory ring. The loop never waits for the intake: a token the mask allowed is
never rejected, and it ends a grammar exactly when it is one of the grammar's stop tokens, so the scheduler learns
a grammar's end without asking. Tokens not taken that way (reasoning, a resumed request) go through a blocking
feed."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING, Any

from pagedllm.executor.abstract import StepFuture
from pagedllm.structured_output.backend import GrammarKey, grammar_key
from pagedllm.structured_output.config import StructuredOutputsConfig
from pagedllm.structured_output.manager import StructuredOutputManager, _shorten_gil_switch_interval
from pagedllm.structured_output.matchers import GrammarBitmask, RequestGrammar
from pagedllm.structured_output.server import GrammarClient, ServerSpec

if TYPE_CHECKING:
    import torch

    from pagedllm.core.request import Request
    from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
    from pagedllm.reasoning import ReasoningParser

_REMOTE = object()
"""`RequestGrammar.matcher` of a request whose matcher lives in the server."""


class RemoteMask(GrammarBitmask):
    """A step's bitmask, filled by the server into a ring slot (its rows: `rids`, in order)."""

    def __init__(self, mgr: ProcessGrammarManager, rids: list[str], states: list[RequestGrammar], slot: int) -> None:
        super().__init__([], mgr.vocab_size, None, mgr.valid_vocab, False, states)  # type: ignore[arg-type]
        self._mgr = mgr
        self.rids = rids
        self.slot = slot
        self.ordered = False
        self.previous: StepFuture | None = None
        """Async scheduling: the step whose tokens this mask needs (`chain`), for a runner that asks for the
        mask before the scheduler read that step (no deferred sampling)."""

    def narrow(self) -> tuple[torch.Tensor, list[int]]:
        if self._narrow is None:
            import torch

            if not self.ordered and self.previous is not None:
                self._mgr.take_result(self.previous.result())
            self._mgr.order_fill(self)
            mask, _, _ = self._mgr.client.filled(self.slot)
            rows = [i for i, st in enumerate(self.states or []) if not st.terminated]
            self._narrow = (torch.from_numpy(mask[: len(self.rids)]), rows)
        return self._narrow


class ProcessGrammarManager(StructuredOutputManager):
    def __init__(
        self,
        config: StructuredOutputsConfig,
        spec: ServerSpec,
        vocab_size: int,
        valid_vocab: int,
        stop_token_ids: Sequence[int],
        reasoning_parser_factory: Callable[[], ReasoningParser] | None = None,
        pin_masks: bool = False,
    ) -> None:
        super().__init__(config, _no_backend, vocab_size, reasoning_parser_factory)
        self.valid_vocab = valid_vocab
        self.stop_ids = frozenset(stop_token_ids)
        self.client = GrammarClient(spec)
        if pin_masks:  # the ring as pinned memory: the runner's upload of a mask does not wait for the stream
            import torch

            masks = self.client.masks
            torch.cuda.cudart().cudaHostRegister(masks.ctypes.data, masks.nbytes, 0)
        self._keys: dict[str, GrammarKey] = {}
        self._asked: set[GrammarKey] = set()
        self._slot = 0
        self._unordered: RemoteMask | None = None
        self._taking: frozenset[int] = frozenset()
        self._taken: Any = None
        """The last step result whose tokens went to the server."""
        self.step_worker = False

    # ---- compile -------------------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        params = req.sampling_params.structured_outputs
        assert params is not None
        key = grammar_key(params, self.config)
        if key not in self._asked or self.client.compiled.get(key, None) is not None:
            self.client.compiled.pop(key, None)
            self.client.compile(key, params)
            self._asked.add(key)
        if not self._in_use:
            self._in_use = True
            _shorten_gil_switch_interval()
        self._keys[req.request_id] = key
        ended = self._reasoning_factory is None or self.config.enable_in_reasoning
        self.states[req.request_id] = RequestGrammar(None, ended)  # type: ignore[arg-type]

    def poll(self, req: Request) -> bool | str:
        st = self.states[req.request_id]
        if st.matcher is not None:
            return True
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
        states: list[RequestGrammar] = []
        done: list[str] = []
        scheduled = so.num_scheduled_tokens
        for rid, st in self._active.items():
            if st.terminated:
                done.append(rid)
                continue
            req = requests.get(rid)
            if rid not in scheduled or req is None or req.num_computed_tokens < req.num_tokens:
                continue
            ids[rid] = len(states)
            states.append(st)
        for rid in done:
            del self._active[rid]
        if states:
            so.structured_output_request_ids = ids
            mask = RemoteMask(self, list(ids), states, self._slot)
            self._slot = (self._slot + 1) % self.client.spec.depth
            self._unordered = mask
            so.grammar_bitmask = mask

    def order_fill(self, mask: RemoteMask) -> None:
        """The server fills `mask` (after any intake sent before): now, unless it was ordered already."""
        if not mask.ordered:
            mask.ordered = True
            self.client.step([], [], mask.rids, mask.slot)
            if self._unordered is mask:
                self._unordered = None

    def begin_update(self, result: ModelRunnerOutput) -> None:
        """(Scheduler, before the step's tokens join their requests) the constrained requests' sampled tokens to
        the server, with the next step's fill order when it is scheduled already."""
        if self._taken is not result:
            self.take_result(result)

    def take_result(self, result: ModelRunnerOutput) -> None:
        """A step's sampled tokens to the server (once per result). A stop token the mask allowed ends its
        grammar: the state says so before the scheduler looks."""
        self._taken = result
        rids: list[str] = []
        tokens: list[int] = []
        taken: list[int] = []
        active = self._active
        failed = result.failed
        for rid, toks in zip(result.req_ids, result.sampled_token_ids):
            st = active.get(rid)
            if st is None or len(toks) != 1 or st.terminated or st.error is not None or (failed and rid in failed):
                continue
            rids.append(rid)
            tokens.append(toks[0])
            taken.append(id(st))
            st.num_seen += 1
            if toks[0] in st.stop_ids:
                st.terminated = True
        self._taking = frozenset(taken)
        nxt = self._unordered
        if nxt is not None:
            nxt.ordered = True
            self._unordered = None
            self.client.step(rids, tokens, nxt.rids, nxt.slot)
        elif rids:
            self.client.intake(rids, tokens)

    def taking(self) -> AbstractSet[int]:
        return self._taking

    def chain(self, so: SchedulerOutput, previous: StepFuture) -> StepFuture:
        """The fill order follows the intake in `begin_update`; the mask keeps `previous` for a runner that asks
        for it first."""
        if isinstance(so.grammar_bitmask, RemoteMask):
            so.grammar_bitmask.previous = previous
        return previous

    def accept(self, req: Request, new_tokens: Sequence[int]) -> bool:
        st = self.states.get(req.request_id)
        if st is None or st.matcher is None:
            return False
        n_out = len(req.output_token_ids)
        if st.num_seen >= n_out:  # taken in `begin_update` (which also set an allowed stop token's end)
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
        err, ended = self.client.feed(req.request_id, fresh)
        if err is not None:
            from pagedllm.structured_output.manager import GrammarRejectedError

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
        super().shutdown()
        self.client.close()


def _no_backend() -> Any:
    raise RuntimeError("the grammar server process compiles; this process has no backend")
