"""Waiting queues: first-come-first-served, or by (priority, arrival) for scheduling_policy="priority"."""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from pagedllm.core.request import Request


class FCFSQueue:
    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, req: Request) -> None:
        self._q.append(req)

    def prepend(self, req: Request) -> None:
        """A preempted request goes back to the front."""
        self._q.appendleft(req)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, req: Request) -> None:
        self._q.remove(req)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class PriorityQueue:
    """Lower `priority` value first, then earlier arrival (as vLLM)."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()

    def add(self, req: Request) -> None:
        heapq.heappush(self._heap, (req.priority, req.arrival_time, next(self._counter), req))

    prepend = add

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, req: Request) -> None:
        self._heap = [e for e in self._heap if e[3] is not req]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (e[3] for e in sorted(self._heap))


def create_request_queue(policy: str) -> FCFSQueue | PriorityQueue:
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"scheduling_policy: expected 'fcfs' or 'priority', got {policy!r}")
