"""The engine core's side of multi-LoRA: adapters are read from disk in a thread, never on the step loop.

A request whose adapter the worker does not hold yet waits here (not in the scheduler) while a thread reads
the files; at the next step the adapter is handed to the worker and the request enters the scheduler. A
request whose adapter fails to load finishes aborted. The worker keeps at most `max_cpu_loras` adapters:
beyond that the least recently used one that no unfinished request needs is dropped.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.logger import init_logger
from pagedllm.lora.peft import LoRAAdapter, load_adapter
from pagedllm.messages import EngineCoreOutput, EngineCoreRequest, FinishReason

logger = init_logger(__name__)


def _add_to_worker(worker: Any, lora_id: int, adapter: LoRAAdapter) -> None:
    worker.model_runner.lora.add_adapter(lora_id, adapter)


def _remove_from_worker(worker: Any, lora_id: int) -> None:
    worker.model_runner.lora.remove_adapter(lora_id)


class LoRAStaging:
    def __init__(self, config: EngineConfig, collective_rpc: Callable[..., list[Any]]) -> None:
        assert config.lora_config is not None
        self.lora_config = config.lora_config
        self.hf_config = config.model_config.hf_config
        self.dtype = config.model_config.dtype
        self.rpc = collective_rpc
        self.pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-load")
        self.registered: OrderedDict[int, str] = OrderedDict()
        """Adapter ids the worker holds -> their paths, least recently used first."""
        self.loading: dict[int, cf.Future[LoRAAdapter]] = {}
        self.parked: dict[str, EngineCoreRequest] = {}

    def admit(self, req: EngineCoreRequest) -> bool:
        """True if the request can be scheduled now; else it waits here for its adapter's files."""
        lr = req.lora_request
        assert lr is not None
        lid = lr.lora_int_id
        if lid in self.registered and self.registered[lid] == lr.lora_path:
            self.registered.move_to_end(lid)
            return True
        if lid not in self.loading:
            lc = self.lora_config
            self.loading[lid] = self.pool.submit(
                load_adapter, lr.lora_path, self.hf_config, lc.max_lora_rank, self.dtype
            )
        self.parked[req.request_id] = req
        return False

    def drop(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self.parked.pop(rid, None)

    def has_parked(self) -> bool:
        return bool(self.parked)

    def busy(self) -> bool:
        """Whether `poll` has work: adapters being read, or more held than max_cpu_loras."""
        return bool(self.loading) or len(self.registered) > self.lora_config.max_cpu_loras

    def poll(
        self, add_request: Callable[[EngineCoreRequest], None], idle: bool, in_use: set[int]
    ) -> list[EngineCoreOutput]:
        """Hands loaded adapters to the worker and their requests to `add_request`; the aborted outputs of
        requests whose adapter failed. `idle`: nothing else to run, so wait a little for a load."""
        if not self.loading:
            self._evict(in_use)
            return []
        if idle:
            cf.wait(list(self.loading.values()), timeout=0.05, return_when=cf.FIRST_COMPLETED)
        failed: list[EngineCoreOutput] = []
        for lid, fut in list(self.loading.items()):
            if not fut.done():
                continue
            del self.loading[lid]
            waiting = [
                r for r in self.parked.values() if r.lora_request is not None and r.lora_request.lora_int_id == lid
            ]
            err: BaseException | None = fut.exception()
            if err is None:
                try:
                    self.rpc(_add_to_worker, (lid, fut.result()))
                except ValueError as e:
                    err = e
            if err is not None:
                logger.error("LoRA adapter %d failed to load: %s", lid, err)
                for r in waiting:
                    del self.parked[r.request_id]
                    failed.append(EngineCoreOutput(r.request_id, [], FinishReason.ABORT, str(err)))
                continue
            path = waiting[0].lora_request.lora_path if waiting and waiting[0].lora_request else ""
            self.registered[lid] = path
            in_use.add(lid)
            self._evict(in_use)
            for r in waiting:
                del self.parked[r.request_id]
                add_request(r)
        return failed

    def _evict(self, in_use: set[int]) -> None:
        extra = len(self.registered) - self.lora_config.max_cpu_loras
        for lid in list(self.registered):
            if extra <= 0:
                break
            if lid in in_use:
                continue
            del self.registered[lid]
            self.rpc(_remove_from_worker, (lid,))
            extra -= 1

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
