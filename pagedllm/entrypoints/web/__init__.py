"""The built-in web UI: a chat page at `/` and a live engine dashboard at `/dashboard`.

Static HTML/JS/CSS shipped inside the package (no build step, no CDN). The pages themselves are public,
so a browser can load them without a key; every API call they make (`/v1/*`, `/dashboard/api/stats`)
goes through the server's normal auth, with the key the page keeps in `sessionStorage`.

The dashboard polls `/dashboard/api/stats` (~1 s). A poll with `fetch` can carry the `Authorization`
header, which `EventSource` (SSE) cannot without putting the key in the URL. Each poll only reads the
Prometheus registry and the core's last `SchedulerStats`, both already collected: the engine step does
no extra work whether or not the page is open.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

from pagedllm.entrypoints.web.stats import DashboardStats

if TYPE_CHECKING:
    from pagedllm.engine.async_llm import AsyncLLM
    from pagedllm.metrics.prometheus import PrometheusStatLogger

STATIC_DIR = Path(str(resources.files(__package__) / "static"))
ASSET_PREFIX = "/ui"


def mount_web_ui(app: FastAPI, engine: AsyncLLM, prometheus: PrometheusStatLogger | None) -> frozenset[str]:
    """Add `/`, `/dashboard`, `/ui/*` and `/dashboard/api/stats` to `app`; return the paths that need
    no API key (the pages and their assets, never the stats API)."""
    stats = DashboardStats(prometheus, engine)

    @app.get("/", include_in_schema=False)
    async def chat_page() -> FileResponse:
        return FileResponse(STATIC_DIR / "chat.html", headers={"Cache-Control": "no-cache"})

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard_page() -> FileResponse:
        return FileResponse(STATIC_DIR / "dashboard.html", headers={"Cache-Control": "no-cache"})

    @app.get("/dashboard/api/stats", include_in_schema=False)
    async def dashboard_stats() -> JSONResponse:
        body: dict[str, Any] = stats.snapshot()
        return JSONResponse(body, headers={"Cache-Control": "no-store"})

    app.mount(ASSET_PREFIX, StaticFiles(directory=STATIC_DIR), name="web-ui")
    assets = {f"{ASSET_PREFIX}/{p.name}" for p in STATIC_DIR.iterdir() if p.is_file()}
    return frozenset({"/", "/dashboard", *assets})
