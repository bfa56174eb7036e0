"""Server-sent events of the streamed responses, and the merged output streams of several prompts."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pagedllm.entrypoints.openai.errors import OpenAIServingError

T = TypeVar("T")


@dataclass
class SSEStream:
    """A streamed response: its SSE text chunks, and the engine requests to abort when it ends (a client
    that disconnects before the first chunk never starts the iterator, so closing it aborts nothing)."""

    iterator: AsyncIterator[str]
    request_ids: list[str] = field(default_factory=list)


def sse(data: str) -> str:
    return f"data: {data}\n\n"


def sse_error(e: OpenAIServingError) -> str:
    return sse(e.to_response().model_dump_json())


async def merge_async_iterators(*iterators: AsyncIterator[T]) -> AsyncIterator[tuple[int, T]]:
    """Items of several async iterators as they come, tagged with the iterator's index. Closing the
    merged iterator (disconnect) cancels the producers, so each one aborts its request."""
    if len(iterators) == 1:
        it = iterators[0]
        try:
            async for item in it:
                yield 0, item
        finally:
            aclose = getattr(it, "aclose", None)
            if aclose is not None:
                await aclose()  # closed at our yield: abort the request now, not at garbage collection
        return
    queue: asyncio.Queue[tuple[int, Any] | BaseException | None] = asyncio.Queue()

    async def drain(i: int, it: AsyncIterator[T]) -> None:
        try:
            async for item in it:
                await queue.put((i, item))
        except Exception as e:
            await queue.put(e)
        finally:
            await queue.put(None)

    tasks = [asyncio.ensure_future(drain(i, it)) for i, it in enumerate(iterators)]
    remaining = len(tasks)
    try:
        while remaining:
            item = await queue.get()  # type: ignore[assignment]
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item  # type: ignore[misc]
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
