"""Rendering of request-supplied chat templates in a separate, killable process.

A Jinja template is code: even inside Jinja's sandbox `{% for i in range(100000) %}{% for j in
range(100000) %}{% endfor %}{% endfor %}` runs for minutes and `{{ 'x' * 500000000 }}` allocates half a
gigabyte. Rendered in the API process, one ~200-byte request froze the event loop (every other client,
`/health` included) and left the process 0.5 GB larger. vLLM refuses request templates unless the server
runs with `--trust-request-chat-template`; pagedllm does the same, and even then renders them here: one
child process (started on first use, spawned so it shares nothing with the server's threads) with an
address-space limit, a wall-clock limit per render (the child is killed and restarted when exceeded) and
a limit on the rendered text's size. Only one render runs at a time, so a hostile template costs at most
one CPU core for `timeout_s`.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import pickle
import threading
from multiprocessing.connection import Connection
from typing import Any

DEFAULT_TIMEOUT_S = 2.0
DEFAULT_MAX_OUTPUT_CHARS = 1 << 20
DEFAULT_MAX_MEMORY_BYTES = 4 << 30
_START_TIMEOUT_S = 120.0


class TemplateLimitError(ValueError):
    """A request's chat template broke a limit (time, size, memory); its message starts with the field."""


def _worker(conn: Connection, tokenizer_bytes: bytes, max_memory_bytes: int, max_output_chars: int) -> None:
    """Child process: render requests from `conn` until it closes. Errors are sent back as strings."""
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (max_memory_bytes, max_memory_bytes))
    except (ImportError, ValueError, OSError):  # pragma: no cover - non-Linux
        pass
    from pagedllm.entrypoints.chat_utils import apply_chat_template

    tokenizer = pickle.loads(tokenizer_bytes)
    conn.send(("ready", None))
    while True:
        try:
            kwargs = conn.recv()
        except EOFError:
            return
        try:
            text = apply_chat_template(tokenizer, **kwargs)
            if len(text) > max_output_chars:
                conn.send(("error", f"chat_template: the rendered prompt exceeds {max_output_chars} characters"))
            else:
                conn.send(("ok", text))
        except MemoryError:
            conn.send(("error", "chat_template: rendering exceeded the memory limit"))
        except Exception as e:
            conn.send(("error", str(e) if isinstance(e, ValueError) else f"chat_template: {type(e).__name__}: {e}"))


class TemplateSandbox:
    """Renders chat templates given by clients in a child process with time, memory and size limits."""

    def __init__(
        self,
        tokenizer: Any,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS,
        max_memory_bytes: int = DEFAULT_MAX_MEMORY_BYTES,
    ) -> None:
        self._tokenizer_bytes = pickle.dumps(tokenizer)
        self.timeout_s = timeout_s
        self.max_output_chars = max_output_chars
        self.max_memory_bytes = max_memory_bytes
        self._proc: mp.process.BaseProcess | None = None
        self._conn: Connection | None = None
        self._lock = threading.Lock()  # one render at a time (also across event loops in tests)

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(
            target=_worker,
            args=(child, self._tokenizer_bytes, self.max_memory_bytes, self.max_output_chars),
            daemon=True,
            name="pagedllm-template-sandbox",
        )
        proc.start()
        child.close()
        if not parent.poll(_START_TIMEOUT_S):
            proc.kill()
            raise RuntimeError("chat template sandbox did not start")
        parent.recv()
        self._proc, self._conn = proc, parent

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(5)
        if self._conn is not None:
            self._conn.close()
        self._proc = self._conn = None

    def render_blocking(self, **kwargs: Any) -> str:
        """`chat_utils.apply_chat_template(tokenizer, **kwargs)` in the child; raises ValueError on any
        template error or broken limit (the child is then restarted for the next request)."""
        with self._lock:
            if self._proc is None or not self._proc.is_alive():
                self._kill()
                self._start()
            assert self._conn is not None
            self._conn.send(kwargs)
            if not self._conn.poll(self.timeout_s):
                self._kill()
                raise TemplateLimitError(f"chat_template: rendering took longer than {self.timeout_s:g} s")
            try:
                status, value = self._conn.recv()
            except EOFError:  # the child died (e.g. killed for memory by the OS)
                self._kill()
                raise TemplateLimitError("chat_template: rendering failed (the sandbox process died)") from None
        if status != "ok":
            raise TemplateLimitError(value)
        return value

    async def render(self, **kwargs: Any) -> str:
        """`render_blocking` off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(None, lambda: self.render_blocking(**kwargs))

    def close(self) -> None:
        with self._lock:
            self._kill()
