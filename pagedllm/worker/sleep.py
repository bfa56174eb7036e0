"""Sleep / wake-up of one worker's device memory (vLLM's sleep mode), without changing tensor identities.

Every parameter, buffer and KV-cache tensor keeps its Python object; only its storage is emptied
(`untyped_storage().resize_(0)`) and later re-grown. Views (tied weights, `Attention.kv_cache`) therefore stay
valid, and the memory really goes back (`torch.cuda.empty_cache()` afterwards hands it to the driver).

- weights, level 1: each storage is copied to (pinned) host memory, then emptied; wake-up copies it back.
- weights, level 2: parameters are dropped (they must be reloaded, e.g. by `update_weights`); buffers (rotary
  tables, not in checkpoints) are still kept on the host.
- KV cache (levels 1 and 2): emptied; wake-up re-grows it zeroed (the engine resets the prefix cache).

CPU layers prepacked for oneDNN (`cpu_gemm`) hold opaque tensors without a resizable storage: level 1 keeps
them aside (they are host memory already), level 2 drops them and wake-up gives the layer back a plain
weight of its shape (packed again by the next weight update). Re-grown storages live at new addresses, so
CUDA graphs are dropped on sleep and captured again on wake-up.
"""

from __future__ import annotations

import gc
from typing import Any

import torch

from pagedllm.logger import init_logger

logger = init_logger(__name__)


def _release_device_cache(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


class WorkerSleeper:
    """Sleeps and wakes one `ModelRunner`'s weights and KV cache."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.weights_level = 0
        """0: weights on the device; 1: offloaded to the host; 2: discarded."""
        self.kv_asleep = False
        self._host: list[tuple[torch.UntypedStorage, torch.Tensor | None, int]] = []
        """(device storage, its host copy or None if discarded, size in bytes)."""
        self._packed: list[tuple[torch.nn.Module, torch.Tensor | None]] = []
        self._kv_sizes: list[tuple[str, torch.Tensor, int]] = []
        """(layer name, KV tensor (or its meta twin when rebound), bytes (-1: rebound))."""

    # ---- weights -------------------------------------------------------------------------------------
    def _weight_tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        model = self.runner.model
        return [p.data for p in model.parameters()], [b for b in model.buffers()]

    def sleep_weights(self, level: int) -> int:
        """Offload (1) or discard (2) the weights; returns the device bytes released."""
        if self.weights_level:
            return 0
        freed = 0
        params, buffers = self._weight_tensors()
        seen: set[int] = set()
        pin = self.runner.device.type == "cuda"
        for t, keep in [(p, level == 1) for p in params] + [(b, True) for b in buffers]:
            if t.is_mkldnn or t.numel() == 0:
                continue
            st = t.untyped_storage()
            if st.data_ptr() in seen or st.nbytes() == 0:
                continue
            seen.add(st.data_ptr())
            host = None
            if keep:
                host = torch.empty(st.nbytes(), dtype=torch.uint8, pin_memory=pin)
                host.untyped_storage().copy_(st)
            self._host.append((st, host, st.nbytes()))
            freed += st.nbytes()
            st.resize_(0)
        for m in self.runner.model.modules():
            packed = getattr(m, "packed_weight", None)
            if packed is not None:
                self._packed.append((m, packed if level == 1 else None))
                m.packed_weight = None
        self.weights_level = level
        return freed

    def wake_weights(self) -> None:
        if not self.weights_level:
            return
        for st, host, nbytes in self._host:
            st.resize_(nbytes)
            if host is not None:
                st.copy_(host.untyped_storage())
        for m, packed in self._packed:
            if packed is not None:
                m.packed_weight = packed
            else:  # discarded (level 2): a plain weight of the layer's shape until the next update packs it
                m.weight.data = torch.empty(  # type: ignore[call-overload]
                    m.packed_out_features, m.packed_in_features, dtype=m.weight.dtype, device=m.weight.device
                )
        self._host, self._packed = [], []
        self.weights_level = 0
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)

    # ---- KV cache ------------------------------------------------------------------------------------
    def sleep_kv_cache(self) -> int:
        if self.kv_asleep:
            return 0
        freed = 0
        runner = self.runner
        for name, kv in list(runner.kv_caches.items()):
            st = kv.untyped_storage()
            freed += st.nbytes()
            if st.resizable():
                self._kv_sizes.append((name, kv, st.nbytes()))
                st.resize_(0)
            else:  # the CPU cache comes from numpy's calloc: rebind the layer to a new tensor on wake-up
                self._kv_sizes.append((name, kv.new_empty(kv.shape, device="meta"), -1))
                runner.kv_caches[name] = runner.attn_layers[name].kv_cache = kv.new_empty(0)
        self.kv_asleep = True
        return freed

    def wake_kv_cache(self) -> None:
        if not self.kv_asleep:
            return
        from pagedllm.worker.runner_setup import alloc_zeroed

        runner = self.runner
        for name, kv, nbytes in self._kv_sizes:
            if nbytes >= 0:
                kv.untyped_storage().resize_(nbytes)
                kv.zero_()
            else:
                new = alloc_zeroed(tuple(kv.shape), kv.dtype, runner.device)
                runner.kv_caches[name] = runner.attn_layers[name].kv_cache = new
        self._kv_sizes = []
        self.kv_asleep = False

    # ---- both ------------------------------------------------------------------------------------------
    def sleep(self, level: int) -> int:
        runner = self.runner
        runner.cuda_graphs = runner.piecewise = runner.mixed_graphs = None  # they point at the storages released below
        runner.verify_graphs = None
        if runner.spec is not None:
            runner.spec.release_graphs()
        freed = self.sleep_weights(level) + self.sleep_kv_cache()
        _release_device_cache(runner.device)
        logger.info("Sleep level %d: released %.2f GiB of %s memory", level, freed / 2**30, runner.device.type)
        return freed

    def wake_up(self, tags: list[str]) -> None:
        if "weights" in tags:
            self.wake_weights()
        if "kv_cache" in tags:
            self.wake_kv_cache()
        runner = self.runner
        if not self.weights_level and not self.kv_asleep and runner.cuda_graphs is None:
            runner.capture_cuda_graphs()
