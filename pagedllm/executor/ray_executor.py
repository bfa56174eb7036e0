"""Workers as Ray actors, placed by a running Ray cluster (vLLM's `--distributed-executor-backend ray`).

Ray only places and supervises the workers: each actor runs the same worker loop as a process of the
multi-process executor (`worker_proc.WorkerProc`), reached over ZMQ TCP sockets bound on the driver's
node, and torch.distributed (NCCL / gloo) rendezvous at rank 0's node. The driver joins the cluster with
`ray.init(address="auto")` unless the caller has already called `ray.init` (a test starts a local head
with `ray.init(num_cpus=...)`). Ray is an optional extra: `pip install "pagedllm[ray]"`.
"""

from __future__ import annotations

import socket
from typing import Any

import zmq

from pagedllm.executor.multiproc_executor import MultiprocExecutor
from pagedllm.logger import init_logger

logger = init_logger(__name__)


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise ValueError("distributed_executor_backend: 'ray' needs Ray installed (pip install 'pagedllm[ray]')") from e
    return ray


class _RayWorker:
    """The actor: reports where rank 0 can rendezvous, then runs the worker loop until SHUTDOWN."""

    def node_address(self) -> tuple[str, int]:
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = int(s.getsockname()[1])
        return ray.util.get_node_ip_address(), port

    def run(self, *args: Any) -> None:
        from pagedllm.executor.worker_proc import run_worker

        run_worker(*args, standalone=False)  # type: ignore[misc]


class RayExecutor(MultiprocExecutor):
    def _bind_sockets(self) -> tuple[str, str]:
        ray = _import_ray()
        if not ray.is_initialized():
            ray.init(address="auto")
        ip = ray.util.get_node_ip_address()
        self.pub.bind(f"tcp://{ip}:*")
        self.pull.bind(f"tcp://{ip}:*")
        return self.pub.getsockopt_string(zmq.LAST_ENDPOINT), self.pull.getsockopt_string(zmq.LAST_ENDPOINT)

    def _start_workers(self, common: tuple[Any, ...]) -> None:
        ray = _import_ray()
        broadcast_addr, reply_addr, output_rank, lps, seed = common
        on_gpu = self.config.device.startswith("cuda")
        actor_cls = ray.remote(num_cpus=0 if on_gpu else 1, num_gpus=1 if on_gpu else 0)(_RayWorker)
        self.actors = [
            actor_cls.options(name=None, max_restarts=0).remote()  # type: ignore[attr-defined]
            for _ in range(self.world_size)
        ]
        ip, port = ray.get(self.actors[0].node_address.remote())
        dist_init = f"tcp://{ip}:{port}"
        self.procs = [
            actor.run.remote(self.config, rank, dist_init, broadcast_addr, reply_addr, output_rank, lps, seed, 1)
            for rank, actor in enumerate(self.actors)
        ]
        logger.info("Ray executor: %d worker actors started (rendezvous %s)", self.world_size, dist_init)

    def _dead_worker(self) -> str | None:
        ray = _import_ray()
        done, _ = ray.wait(list(self.procs), num_returns=1, timeout=0)
        if not done:
            return None
        rank = self.procs.index(done[0])
        try:
            ray.get(done[0])
            why = "exited"
        except Exception as e:
            why = f"died ({type(e).__name__})"
        return f"worker rank {rank} (Ray actor) {why}"

    def _wait_any_exit(self, timeout: float | None) -> None:
        ray = _import_ray()
        ray.wait(list(self.procs), num_returns=1, timeout=timeout)

    def _stop_workers(self, graceful_s: float) -> None:
        ray = _import_ray()
        if graceful_s > 0:
            ray.wait(list(self.procs), num_returns=len(self.procs), timeout=graceful_s)
        for actor in getattr(self, "actors", []):
            ray.kill(actor, no_restart=True)
