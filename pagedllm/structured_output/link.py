"""The engine's side of the grammar server (`server.py`): the started server's link (its client, the shared
segment's views and, on CUDA, its registration as pinned, mapped memory) and the step masks the runner applies
(`ServerMask`: the device waits for the server's flag, `host_flags.py`). The manager is `remote.py`."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from pagedllm.structured_output.apply import apply_rows_cpu, launch_mask_kernel, upload_row_map
from pagedllm.structured_output.client import GrammarClient, ServerProcess
from pagedllm.structured_output.server import MASKS, TOKENS, ServerSpec

if TYPE_CHECKING:
    import torch


class MaskRows:
    """Where a mask's rows go in the step's logits: row k -> logit_of_row[k] (-1: not sampled)."""

    __slots__ = ("all_sampled", "device_map", "identity", "key", "logit_of_row")

    def __init__(self, key: tuple[Any, ...], logit_of_row: np.ndarray, n_logits: int, device: Any) -> None:
        m = len(logit_of_row)
        self.key = key
        self.logit_of_row = logit_of_row
        self.identity = n_logits >= m and bool((logit_of_row == np.arange(m)).all())
        self.all_sampled = bool((logit_of_row >= 0).all())
        self.device_map: torch.Tensor | None = None
        """On a CUDA engine, the map on the device (None when the rows are the logits' first rows, in order)."""
        if not self.identity and getattr(device, "type", "cpu") == "cuda":
            self.device_map = upload_row_map(device, logit_of_row)


class ServerMask:
    """Step mask number `k`, filled by the server into its ring slot (rows: `rids`, in order). The runner calls
    `apply_to` and, after sampling, `publish_sampled`."""

    defer_sampling = False
    """The runner launches the sampling with the forward (the wait for the mask is on the device)."""

    def __init__(
        self,
        link: ServerLink,
        k: int,
        row_of_rid: dict[str, int],
        on_published: Callable[[int], None],
        on_failed: Callable[[Sequence[str], str], None],
    ) -> None:
        self._link = link
        self._on_published = on_published
        self._on_failed = on_failed
        self.k = k
        self.row_of_rid = row_of_rid
        self.rids = list(row_of_rid)
        self.published = False
        """Its sampled ids went to the server (the server takes them; `begin_update` counts them seen)."""
        self._rows: MaskRows

    def apply_to(self, logits: torch.Tensor, req_ids: Sequence[str], sample_idx: np.ndarray) -> None:
        """Mask the sampled rows' logits: on the device after a stream wait for the fill (CUDA), or once the
        host saw the fill (CPU)."""
        link, m, k = self._link, len(self.rids), self.k
        rows = link.rows_for(self.rids, self.row_of_rid, req_ids, sample_idx, logits.shape[0], logits.device)
        self._rows = rows
        vocab = min(logits.shape[-1], link.valid_vocab)
        if logits.is_cuda:
            flags = link.host_mem
            assert flags is not None
            flags.wait_geq(link.flag_address(MASKS), k)
            dev = link.device_mask(logits.device, m)
            dev.copy_(link.mask_views[k % link.depth][:m], non_blocking=True)
            launch_mask_kernel(logits, dev, rows.device_map, vocab)
            return
        if not link.client.wait_mask(k):
            self._on_failed(self.rids, "structured_outputs: the grammar server did not fill a step's mask in time")
            return
        lor = rows.logit_of_row
        kept = np.nonzero(lor >= 0)[0]
        apply_rows_cpu(logits, link.mask_views[k % link.depth], lor[kept].tolist(), kept.tolist(), vocab, None)

    def publish_sampled(self, sampled: torch.Tensor) -> None:
        """This step's sampled ids of the mask's rows to the server (int64 [n], the logits' rows)."""
        link, m, k, rows = self._link, len(self.rids), self.k, self._rows
        host = link.token_views[k % link.depth][:m]
        if sampled.is_cuda:
            import torch

            if rows.device_map is None:
                host.copy_(sampled[:m], non_blocking=True)
            elif rows.all_sampled:
                ids = link.device_ids(sampled.device, m)
                torch.index_select(sampled, 0, rows.device_map, out=ids)
                host.copy_(ids, non_blocking=True)
            else:  # rows the runner did not sample: -1
                src = rows.device_map
                host.copy_(torch.where(src >= 0, sampled.index_select(0, src.clamp(min=0)), -1), non_blocking=True)
            assert link.host_mem is not None
            link.host_mem.write(link.flag_address(TOKENS), k)
        else:
            got = sampled.tolist()
            lor = rows.logit_of_row
            link.client.publish(k, got[:m] if rows.identity else [got[j] if j >= 0 else -1 for j in lor.tolist()])
        self.published = True
        self._on_published(k)


class ServerLink:
    """The started grammar server, seen from the engine: its client, the shared segment's views and (CUDA) its
    registration as pinned, mapped memory, and a watchdog: a dead server would leave the device waiting on its
    flag forever, so the watchdog releases every wait and marks the link dead (the requests fail)."""

    def __init__(
        self,
        spec: ServerSpec,
        valid_vocab: int,
        stop_ids: frozenset[int],
        cuda: bool,
        process: ServerProcess | None = None,
    ) -> None:
        import torch

        self.client = GrammarClient(spec, process)
        self.valid_vocab = valid_vocab
        self.stop_ids = stop_ids
        self.depth = spec.depth
        rings = self.client.rings
        self.mask_views = [torch.from_numpy(rings.masks[i]) for i in range(spec.depth)]
        self.token_views = [torch.from_numpy(rings.tokens[i]) for i in range(spec.depth)]
        self.host_mem: Any = None
        self._flags_address = int(rings.flags.ctypes.data)
        """(Read twice a structured step: `ndarray.ctypes` builds an object per access.)"""
        self._cuda = cuda
        self._dead = False
        self._closed = threading.Event()
        self.last_k = 0
        """(The step loop) the number of the last mask ordered: the watchdog releases the waits past it."""
        self._device_masks: dict[Any, torch.Tensor] = {}
        self._device_ids: dict[Any, torch.Tensor] = {}
        self._rows: MaskRows | None = None
        """The last mask's row places (`rows_for`)."""

    def attach(self) -> None:
        """(The step loop, once) the registration with the driver (in the thread whose CUDA context the runner
        uses) and the watchdog."""
        if self._cuda and self.host_mem is None:
            from pagedllm.structured_output.host_flags import RegisteredHostMemory

            self.host_mem = RegisteredHostMemory(self._flags_address, self.client._shm.size)
            threading.Thread(target=self._watch, name="grammar-watchdog", daemon=True).start()

    def device_mask(self, device: Any, m: int) -> torch.Tensor:
        import torch

        buf = self._device_masks.get(device)
        if buf is None:
            spec = self.client.spec
            buf = torch.empty((spec.rows, spec.words), dtype=torch.int32, device=device)
            self._device_masks[device] = buf
        return buf[:m]

    def device_ids(self, device: Any, m: int) -> torch.Tensor:
        """A device buffer for m sampled ids in mask-row order."""
        import torch

        buf = self._device_ids.get(device)
        if buf is None:
            buf = torch.empty(self.client.spec.rows, dtype=torch.int64, device=device)
            self._device_ids[device] = buf
        return buf[:m]

    def rows_for(
        self,
        rids: list[str],
        row_of_rid: dict[str, int],
        req_ids: Sequence[str],
        sample_idx: np.ndarray,
        n_logits: int,
        device: Any,
    ) -> MaskRows:
        """The mask rows' places in the logits; in steady decoding the same as the step before (the same rows,
        the same batch): then nothing is computed or uploaded."""
        last = self._rows
        if last is not None:
            lrids, lreq, lidx = last.key
            if lrids == rids and lreq == req_ids and np.array_equal(lidx, sample_idx):
                return last
        m = len(rids)
        logit_of_row = np.full(m, -1, dtype=np.int64)
        get = row_of_rid.get
        for j, i in enumerate(sample_idx.tolist()):
            r = get(req_ids[i])
            if r is not None:
                logit_of_row[r] = j
        self._rows = rows = MaskRows((rids, list(req_ids), sample_idx.copy()), logit_of_row, n_logits, device)
        return rows

    def flag_address(self, index: int) -> int:
        return self._flags_address + 4 * index

    @property
    def dead(self) -> bool:
        return self._dead or self.client.dead

    def _watch(self) -> None:
        while not self._closed.wait(0.5):
            if not self.client.alive:
                self.client.rings.flags[MASKS] = (self.last_k + (1 << 20)) & 0x7FFFFFFF
                self._dead = True
                return

    def close(self) -> None:
        self._closed.set()
        if self.host_mem is not None:
            self.host_mem.unregister()
        self.client.close()
