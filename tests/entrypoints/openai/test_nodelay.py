"""The server's HTTP protocol turns Nagle's algorithm off on every connection, including those accepted on the
shared `reuse_port` socket of several API-server processes (made with proto 0, which asyncio does not set
TCP_NODELAY on). With Nagle on, a stream's first small SSE chunks waited for the client's delayed ACK (~40 ms)."""

from __future__ import annotations

import asyncio
import socket
import time

import uvicorn
from starlette.applications import Starlette
from starlette.responses import StreamingResponse
from starlette.routing import Route

from pagedllm.entrypoints.openai.middleware import TimeoutH11Protocol


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_connections_on_a_shared_socket_have_nodelay() -> None:
    flags: list[int] = []

    class Recording(TimeoutH11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            flags.append(transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

    async def chunks():  # noqa: ANN202
        for i in range(4):
            yield f"data: {i}\n\n"
            await asyncio.sleep(0.02)

    async def stream(request):  # noqa: ANN001, ANN202
        return StreamingResponse(chunks(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/s", stream, methods=["POST"])])
    port = _free_port()

    async def main() -> list[list[float]]:
        listener = socket.create_server(("127.0.0.1", port), reuse_port=True)  # as server_main makes it
        assert listener.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 0
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", http=Recording))
        task = asyncio.create_task(server.serve(sockets=[listener]))
        while not server.started:
            await asyncio.sleep(0.01)
        arrivals = []
        import aiohttp

        async with aiohttp.ClientSession() as session:
            for _ in range(3):
                t0, times = time.perf_counter(), []
                async with session.post(f"http://127.0.0.1:{port}/s", json={"prompt": "x" * 1000}) as resp:
                    async for line in resp.content:
                        if line.startswith(b"data"):
                            times.append(time.perf_counter() - t0)
                arrivals.append(times)
        server.should_exit = True
        await task
        return arrivals

    arrivals = asyncio.run(main())
    assert flags and all(f == 1 for f in flags), flags
    for times in arrivals:  # the chunks come 20 ms apart, not bunched behind a delayed ACK
        assert len(times) == 4 and times[1] - times[0] > 0.01, times
