"""Operator routes (vLLM's): `POST /sleep?level=N`, `POST /wake_up?tags=...`, `GET /is_sleeping`,
`POST /reset_prefix_cache`, `POST /collective_rpc` only with `PAGEDLLM_SERVER_DEV_MODE=1` (vLLM's
VLLM_SERVER_DEV_MODE; the sleep routes also need `--enable-sleep-mode`), and `POST /start_profile`,
`/stop_profile` when a profiler directory is configured (`--profiler-config` or PAGEDLLM_TORCH_PROFILER_DIR).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response

from pagedllm import envs
from pagedllm.engine.controls import EngineSleepingError
from pagedllm.entrypoints.openai.errors import error_body


def dev_mode() -> bool:
    return envs.PAGEDLLM_SERVER_DEV_MODE


def _utility_error(e: Exception) -> JSONResponse:
    """A failed utility call: the core's ValueError (bad input) is a 400, anything else a 500."""
    msg = str(e)
    status = 400 if msg.startswith("ValueError") else 500
    return JSONResponse(error_body(msg, status), status_code=status)


def add_control_routes(app: FastAPI, engine: Any) -> None:
    extra = engine.config.extra

    @app.exception_handler(EngineSleepingError)
    async def sleeping(_: Request, exc: EngineSleepingError) -> JSONResponse:
        return JSONResponse(error_body(str(exc), 503), status_code=503)

    async def call(coro: Any) -> Any:
        try:
            return await coro
        except RuntimeError as e:
            if isinstance(e, EngineSleepingError):
                raise
            return _utility_error(e)

    if dev_mode():

        @app.post("/reset_prefix_cache")
        async def reset_prefix_cache() -> Response:
            res = await call(engine.reset_prefix_cache())
            return res if isinstance(res, Response) else Response(status_code=200)

        @app.post("/collective_rpc")
        async def collective_rpc(request: Request) -> Response:
            body = await request.json()
            method = body.get("method") if isinstance(body, dict) else None
            if not isinstance(method, str):
                return JSONResponse(error_body("method: expected a worker method name", 400), status_code=400)
            res = await call(
                engine.collective_rpc(method, body.get("timeout"), tuple(body.get("args") or ()), body.get("kwargs"))
            )
            return res if isinstance(res, Response) else JSONResponse({"results": res})

        if extra.get("enable_sleep_mode"):

            @app.post("/sleep")
            async def sleep(level: int = 1) -> Response:
                res = await call(engine.sleep(level))
                return res if isinstance(res, Response) else Response(status_code=200)

            @app.post("/wake_up")
            async def wake_up(tags: Annotated[list[str] | None, Query()] = None) -> Response:
                res = await call(engine.wake_up(tags))
                return res if isinstance(res, Response) else Response(status_code=200)

            @app.get("/is_sleeping")
            async def is_sleeping() -> Response:
                res = await call(engine.is_sleeping())
                return res if isinstance(res, Response) else JSONResponse({"is_sleeping": res})

    profiler = extra.get("profiler_config") or {}
    if profiler.get("torch_profiler_dir") or envs.PAGEDLLM_TORCH_PROFILER_DIR:

        @app.post("/start_profile")
        async def start_profile() -> Response:
            res = await call(engine.start_profile())
            return res if isinstance(res, Response) else Response(status_code=200)

        @app.post("/stop_profile")
        async def stop_profile() -> Response:
            res = await call(engine.stop_profile())
            return res if isinstance(res, Response) else Response(status_code=200)
