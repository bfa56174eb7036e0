"""`pagedllm serve` end to end (acceptance 1-4): one server subprocess with the default model for the whole
module, driven through the official `openai` package (sync and async) and raw HTTP."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")
import httpx  # noqa: E402
import openai  # noqa: E402
from openai.types import Completion, Model  # noqa: E402
from openai.types.chat import ChatCompletion, ChatCompletionChunk  # noqa: E402

API_KEY = "token-abc"
MAX_MODEL_LEN = 1024
# float32: greedy outputs must not depend on the batch (bf16 rounding turns near-ties into flips).
ENGINE_FLAGS = ["--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory-bytes", str(128 << 20), "--dtype", "float32"]
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
CHATS = [
    [{"role": "user", "content": "Tell me a joke about cats."}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "What is 2 + 2?"}]},
    ],
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m pagedllm serve ...` in a subprocess; its log goes to a temp file."""

    def __init__(self, extra_args: list[str], env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="pagedllm-serve-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "pagedllm", "serve", "--port", str(self.port), *extra_args]
        self.proc = subprocess.Popen(
            cmd,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PAGEDLLM_CPU_THREADS": "2", **(env or {})},
        )

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.read_log()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"server not ready in {timeout} s:\n{self.read_log()[-3000:]}")

    def read_log(self) -> str:
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            return f.read()

    def core_pid(self) -> int:
        import re

        m = re.search(r"Engine core process started \(pid (\d+)\)", self.read_log())
        assert m, "core pid not logged"
        return int(m.group(1))

    def __enter__(self) -> ServerProcess:
        """Ready to serve (the module fixtures' `with ServerProcess(args) as srv: yield srv`)."""
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()
        os.unlink(self.log.name)


def server_args(api_server_count: int = 1) -> list[str]:
    """The module server's flags; PAGEDLLM_TEST_API_SERVERS=2 runs this whole module through two API-server
    processes (by hand; CI runs a selection of it that way: test_server_multi_api.py)."""
    n = int(os.environ.get("PAGEDLLM_TEST_API_SERVERS", "0")) or api_server_count
    return [
        "--api-key",
        API_KEY,
        "--served-model-name",
        "smollm2",
        "smol",
        "--max-request-body-bytes",
        str(4 << 20),
        *(["--api-server-count", str(n)] if n != 1 else []),
        *ENGINE_FLAGS,
    ]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess(server_args()) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline(server: ServerProcess):  # noqa: ANN201 - pagedllm.LLM; loaded after the server is up
    from pagedllm import LLM

    return LLM(max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=128 << 20, dtype="float32")


def post(
    server: ServerProcess,
    path: str,
    body: Any = None,
    *,
    content: bytes | None = None,
    headers: dict[str, str] | None = None,
    auth: bool = True,
) -> httpx.Response:
    h = {"Authorization": f"Bearer {API_KEY}"} if auth else {}
    h.update(headers or {})
    if content is not None:
        h.setdefault("Content-Type", "application/json")
        return httpx.post(server.url + path, content=content, headers=h, timeout=120)
    return httpx.post(server.url + path, json=body, headers=h, timeout=120)


def sse_events(resp: httpx.Response) -> list[Any]:
    events = []
    for line in resp.text.splitlines():
        if line.startswith("data: "):
            data = line[6:]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


# ---- acceptance 1 ----------------------------------------------------------------------------------
def test_completions_and_chat_match_offline(server: ServerProcess, client: openai.OpenAI, offline) -> None:  # noqa: ANN001
    from pagedllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=12)
    for prompt in PROMPTS:
        ref = offline.generate(prompt, sp, use_tqdm=False)[0].outputs[0].text
        got = client.completions.create(model="smollm2", prompt=prompt, max_tokens=12, temperature=0)
        assert got.choices[0].text == ref
        stream = client.completions.create(model="smollm2", prompt=prompt, max_tokens=12, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices) == ref
        raw = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 12, "temperature": 0})
        Completion.model_validate(raw.json())
    for messages in CHATS:
        ref = offline.chat(messages, sp, use_tqdm=False)[0].outputs[0].text
        got = client.chat.completions.create(model="smol", messages=messages, max_tokens=12, temperature=0)
        assert got.choices[0].message.content == ref
        assert got.choices[0].message.role == "assistant"
        stream = client.chat.completions.create(
            model="smol", messages=messages, max_tokens=12, temperature=0, stream=True
        )
        chunks = list(stream)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref
        raw = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 12, "temperature": 0})
        ChatCompletion.model_validate(raw.json())
        raw = post(
            server,
            "/v1/chat/completions",
            {
                "messages": messages,
                "max_tokens": 8,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            },
        )
        events = sse_events(raw)
        assert events[-1] == "[DONE]"
        for ev in events[:-1]:
            ChatCompletionChunk.model_validate(ev)
            assert ev["usage"] is not None  # continuous_usage_stats


def test_completion_prompt_forms_echo_and_usage(server: ServerProcess, client: openai.OpenAI) -> None:
    ids = post(server, "/tokenize", {"prompt": PROMPTS[0]}).json()["tokens"]
    forms: list[Any] = [PROMPTS[0], [PROMPTS[0], PROMPTS[1]], ids, [ids, ids]]
    texts = []
    for form in forms:
        r = client.completions.create(model="smollm2", prompt=form, max_tokens=6, temperature=0)
        n_prompts = len(form) if isinstance(form, list) and not isinstance(form[0], int) else 1
        assert len(r.choices) == n_prompts and [c.index for c in r.choices] == list(range(n_prompts))
        assert r.usage is not None and r.usage.completion_tokens == 6 * n_prompts
        texts.append(r.choices[0].text)
    assert len(set(texts)) == 1  # text and token-id prompts agree
    r = client.completions.create(model="smollm2", prompt=PROMPTS[0], max_tokens=4, temperature=0, echo=True)
    echoed = r.choices[0].text
    assert echoed.startswith(PROMPTS[0]) and texts[0].startswith(echoed[len(PROMPTS[0]) :])
    assert r.usage.prompt_tokens == len(ids)
    raw = post(server, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 5, "stop": ["\n"]}).json()
    Completion.model_validate(raw)


def test_n3_with_seed_and_stream_usage(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="smol", messages=CHATS[0], n=3, seed=7, temperature=1.0, max_tokens=8)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    again = client.chat.completions.create(model="smol", messages=CHATS[0], n=3, seed=7, temperature=1.0, max_tokens=8)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]
    stream = client.completions.create(
        model="smollm2",
        prompt=PROMPTS[1],
        n=3,
        seed=3,
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1, 2}
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 24
    assert all(c.usage is None for c in chunks[:-1])


def test_models_tokenize_detokenize(server: ServerProcess, client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["smollm2", "smol"]
    raw = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).json()
    for m in raw["data"]:
        Model.model_validate(m)
    tok = post(server, "/tokenize", {"prompt": "Hello world, how are you?", "return_token_strs": True}).json()
    assert tok["count"] == len(tok["tokens"]) == len(tok["token_strs"]) and tok["max_model_len"] == MAX_MODEL_LEN
    detok = post(server, "/detokenize", {"tokens": tok["tokens"]}).json()
    assert detok["prompt"] == "Hello world, how are you?"
    chat_tok = post(server, "/tokenize", {"messages": CHATS[0]}).json()
    assert chat_tok["count"] > tok["count"]
    assert httpx.get(server.url + "/version").json()["version"]
    assert httpx.get(server.url + "/openapi.json", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200


def test_async_client_streaming(server: ServerProcess) -> None:
    async def run() -> tuple[str, str]:
        ac = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
        full = await ac.chat.completions.create(model="smol", messages=CHATS[1], max_tokens=16, temperature=0)
        stream = await ac.chat.completions.create(
            model="smol", messages=CHATS[1], max_tokens=16, temperature=0, stream=True
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        await ac.close()
        return full.choices[0].message.content or "", text

    full, streamed = asyncio.run(run())
    assert full == streamed and full


# ---- acceptance 2 ----------------------------------------------------------------------------------
def test_64_concurrent_streams_equal_non_streamed(server: ServerProcess) -> None:
    topics = ["cats", "dogs", "the sea", "rain", "bread", "trains", "music", "winter"]
    convs = [
        [{"role": "user", "content": f"Write one sentence about {topics[i % 8]}, variant {i}."}] for i in range(64)
    ]

    async def run() -> tuple[list[str], list[str]]:
        ac = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)

        async def streamed(m: list[dict[str, str]]) -> str:
            s = await ac.chat.completions.create(model="smol", messages=m, max_tokens=8, temperature=0, stream=True)
            return "".join([c.choices[0].delta.content or "" async for c in s if c.choices])

        async def plain(m: list[dict[str, str]]) -> str:
            r = await ac.chat.completions.create(model="smol", messages=m, max_tokens=8, temperature=0)
            return r.choices[0].message.content or ""

        a = await asyncio.gather(*[streamed(m) for m in convs])
        b = await asyncio.gather(*[plain(m) for m in convs])
        await ac.close()
        return a, b

    streamed_texts, plain_texts = asyncio.run(run())
    assert all(streamed_texts)
    assert streamed_texts == plain_texts


# ---- acceptance 3 ----------------------------------------------------------------------------------
def metric(server: ServerProcess, name: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    for line in text.splitlines():
        if line.startswith(f"pagedllm:{name}{{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def test_client_disconnect_aborts(server: ServerProcess) -> None:
    idle_kv = metric(server, "kv_cache_usage_perc")
    body = {"model": "smollm2", "prompt": "Count forever:", "max_tokens": 900, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}

    def stream_then_drop() -> None:
        with (
            httpx.Client(timeout=120) as c,
            c.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, headers=headers) as r,
        ):
            seen = 0
            for line in r.iter_lines():
                if line.startswith("data: "):
                    seen += 1
                if seen >= 3:
                    break  # leaving the with-block closes the connection mid-stream

    def wait_then_drop() -> None:
        try:
            httpx.post(server.url + "/v1/completions", json=body, headers=headers, timeout=3)
        except httpx.TimeoutException:
            pass

    threads = [threading.Thread(target=stream_then_drop) for _ in range(16)]
    threads += [threading.Thread(target=wait_then_drop) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        running, waiting = metric(server, "num_requests_running"), metric(server, "num_requests_waiting")
        if running == 0 and waiting == 0 and metric(server, "kv_cache_usage_perc") <= idle_kv:
            break
        time.sleep(0.25)
    assert metric(server, "num_requests_running") == 0
    assert metric(server, "num_requests_waiting") == 0
    assert metric(server, "kv_cache_usage_perc") <= idle_kv
    assert metric(server, "generation_tokens_total") < 20 * 900  # they were cut short


# ---- acceptance 4 ----------------------------------------------------------------------------------
BAD_INPUTS: list[tuple[str, str, Any, int, str]] = [
    # (name, path, body (dict, or bytes sent raw), status, message substring)
    ("malformed_json", "/v1/completions", b'{"prompt": "x", ', 400, "Invalid JSON"),
    ("wrong_type", "/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ("prompt_wrong_type", "/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("negative_max_tokens", "/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    (
        "negative_temperature",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "temperature": -1},
        400,
        "temperature",
    ),
    ("prompt_over_context", "/v1/completions", {"prompt": "hello " * 1500}, 400, "maximum context length is 1024"),
    ("max_tokens_over_context", "/v1/completions", {"prompt": "hi", "max_tokens": 5000}, 400, "1024"),
    ("unknown_model", "/v1/completions", {"model": "gpt-9", "prompt": "x"}, 404, "gpt-9"),
    ("empty_messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("bad_role", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
    (
        "bad_content_part",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "x"}}]}]},
        400,
        "text",
    ),
    (
        "image_part_without_url",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "image_url",
    ),
    ("suffix", "/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("n_zero", "/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("top_p_zero", "/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("token_out_of_vocab", "/v1/completions", {"prompt": [1, 99999999]}, 400, "vocab"),
    (
        "stream_options_without_stream",
        "/v1/completions",
        {"prompt": "x", "stream_options": {"include_usage": True}},
        400,
        "stream",
    ),
    ("one_mb_prompt", "/v1/completions", {"prompt": "a b " * 260_000}, 400, "maximum context length"),
    ("body_over_limit", "/v1/completions", {"prompt": "x" * (5 << 20)}, 413, "too large"),
    ("invalid_utf8", "/v1/completions", b'{"prompt": "\xff\xfe"}', 400, "UTF-8"),
    (
        "chat_template_path",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "chat_template": "/etc/passwd"},
        400,
        "chat_template",
    ),
    ("detokenize_bad_id", "/detokenize", {"tokens": [10**8]}, 400, "vocabulary"),
    ("detokenize_negative_id", "/detokenize", {"tokens": [-5]}, 400, "tokens"),
    (
        "chat_template_untrusted",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ messages[0].content }}"},
        400,
        "--trust-request-chat-template",
    ),
    (
        "auto_tool_choice_without_flags",
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": "auto",
        },
        400,
        '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
    ),
]


@pytest.mark.parametrize("name,path,body,status,substring", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_inputs(server: ServerProcess, name: str, path: str, body: Any, status: int, substring: str) -> None:
    resp = post(server, path, content=body) if isinstance(body, bytes) else post(server, path, body)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status
    assert substring.lower() in err["message"].lower(), err


def test_auth_required(server: ServerProcess) -> None:
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        resp = post(server, path, {"prompt": "x"}, auth=False)
        assert resp.status_code == 401 and resp.json()["error"]["code"] == 401
    wrong = post(server, "/v1/completions", {"prompt": "x"}, headers={"Authorization": "Bearer nope"}, auth=False)
    assert wrong.status_code == 401
    assert httpx.get(server.url + "/v1/models").status_code == 401
    for path in ("/health", "/version", "/metrics", "/ping"):
        assert httpx.get(server.url + path).status_code == 200


def test_bad_inputs_do_not_delay_others(server: ServerProcess) -> None:
    """Bad requests (incl. 1 MB prompts) sent while a normal streaming request runs add less than a second
    to any of its inter-token gaps (compared with the same request alone), and a request right after
    still succeeds. (The stream is long enough for several bad requests to overlap it on a loaded machine: at
    40 tokens a full CI run once saw only 4.)"""

    def normal(gaps: list[float], done: threading.Event) -> None:
        with (
            httpx.Client(timeout=120) as c,
            c.stream(
                "POST",
                server.url + "/v1/completions",
                headers={"Authorization": f"Bearer {API_KEY}"},
                json={"prompt": "Count:", "max_tokens": 96, "ignore_eos": True, "stream": True},
            ) as r,
        ):
            last = time.monotonic()
            for line in r.iter_lines():
                if line.startswith("data: "):
                    now = time.monotonic()
                    gaps.append(now - last)
                    last = now
        done.set()

    alone: list[float] = []
    normal(alone, threading.Event())
    gaps: list[float] = []
    done = threading.Event()
    t = threading.Thread(target=normal, args=(gaps, done))
    t.start()
    time.sleep(0.3)
    sent = during = 0
    # Every bad input at least once (on a loaded machine the stream may end first), more while it runs.
    while sent < len(BAD_INPUTS) or (not done.is_set() and sent < 3 * len(BAD_INPUTS)):
        _, path, body, status, _ = BAD_INPUTS[sent % len(BAD_INPUTS)]
        running = not done.is_set()
        resp = post(server, path, content=body) if isinstance(body, bytes) else post(server, path, body)
        assert resp.status_code == status
        sent += 1
        during += running and not done.is_set()
    t.join(120)
    assert during >= 5, f"only {during} bad requests overlapped the stream"
    assert len(gaps) > 10 and max(gaps[1:]) < max(alone[1:]) + 1.0, (max(alone[1:]), max(gaps[1:]))
    ok = post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 4})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"]


def test_metrics_exposed(server: ServerProcess) -> None:
    text = httpx.get(server.url + "/metrics").text
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "prefix_cache_queries_total",
        "prefix_cache_hits_total",
        "num_preemptions_total",
        "prompt_tokens_total",
        "generation_tokens_total",
        "request_success_total",
        "time_to_first_token_seconds_bucket",
        "inter_token_latency_seconds_bucket",
        "e2e_request_latency_seconds_bucket",
        "request_prompt_tokens_bucket",
        "request_generation_tokens_bucket",
        "request_queue_time_seconds_bucket",
    ):
        assert f"pagedllm:{name}{{" in text, name
    assert 'model_name="smollm2"' in text
    assert metric(server, "prompt_tokens_total") > 0
    assert metric(server, "prefix_cache_queries_total") >= metric(server, "prefix_cache_hits_total") > 0


def test_penalties_and_logprobs(server: ServerProcess) -> None:
    """Passed through when SamplingParams has them (the sampling features), else a 400 naming the field."""
    from pagedllm.entrypoints.openai.serving_base import sampling_supports

    body = {
        "prompt": PROMPTS[0],
        "max_tokens": 4,
        "temperature": 0,
        "logprobs": 2,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.5,
    }
    resp = post(server, "/v1/completions", body)
    if not sampling_supports("logprobs"):
        assert resp.status_code == 400
        return
    assert resp.status_code == 200, resp.text
    lp = Completion.model_validate(resp.json()).choices[0].logprobs
    assert lp is not None and len(lp.tokens) == 4 and len(lp.token_logprobs) == 4
    assert all(1 <= len(t) <= 3 for t in lp.top_logprobs or [])
    chat = post(
        server,
        "/v1/chat/completions",
        {"messages": CHATS[0], "max_tokens": 4, "temperature": 0, "logprobs": True, "top_logprobs": 2},
    )
    assert chat.status_code == 200, chat.text
    content = ChatCompletion.model_validate(chat.json()).choices[0].logprobs.content
    assert content is not None and len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)


# ---- sampling over HTTP: logprobs, best_of, beam search --------------------------------------------------
LP_TOL = 1e-3


def _ref_steps(logprobs: Any, token_ids: list[int]) -> list[tuple[str, float, dict[str, float]]]:
    """Offline logprobs per position: (token text, its logprob, {candidate text: logprob})."""
    return [
        (pos[t].decoded_token, pos[t].logprob, {v.decoded_token: v.logprob for v in pos.values()})
        for t, pos in zip(token_ids, logprobs)
    ]


def _check_completion_lps(lp: dict[str, Any], ref: list[tuple[str, float, dict[str, float]]]) -> None:
    assert lp["tokens"] == [r[0] for r in ref]
    for got, want in zip(lp["token_logprobs"], ref):
        assert abs(got - want[1]) <= LP_TOL, (got, want)
    for got_top, want in zip(lp["top_logprobs"], ref):
        assert set(got_top) == set(want[2])
        assert all(abs(got_top[k] - v) <= LP_TOL for k, v in want[2].items()), (got_top, want[2])
    offsets = [0]
    for tok in lp["tokens"][:-1]:
        offsets.append(offsets[-1] + len(tok))
    assert lp["text_offset"] == offsets


def _check_chat_lps(content: list[dict[str, Any]], ref: list[tuple[str, float, dict[str, float]]], top: int) -> None:
    assert [c["token"] for c in content] == [r[0] for r in ref]
    for c, (_, want, cands) in zip(content, ref):
        assert abs(c["logprob"] - want) <= LP_TOL and c["bytes"] == list(c["token"].encode())
        best = sorted(cands.items(), key=lambda kv: -kv[1])[:top]
        assert [t["token"] for t in c["top_logprobs"]] == [k for k, _ in best]
        assert all(abs(t["logprob"] - v) <= LP_TOL for t, (_, v) in zip(c["top_logprobs"], best))


def test_logprobs_match_offline(server: ServerProcess, offline) -> None:  # noqa: ANN001
    """Completions logprobs=3 and chat logprobs/top_logprobs=3, streamed and not: valid OpenAI types, and
    token by token the offline engine's values."""
    from openai.types.completion_choice import Logprobs

    from pagedllm import SamplingParams

    sp = SamplingParams(logprobs=3, temperature=0.0, max_tokens=8)
    ref_out = offline.generate(PROMPTS[0], sp, use_tqdm=False)[0].outputs[0]
    ref = _ref_steps(ref_out.logprobs, ref_out.token_ids)
    body = {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, "logprobs": 3}
    raw = post(server, "/v1/completions", body).json()
    Completion.model_validate(raw)
    assert raw["choices"][0]["text"] == ref_out.text
    _check_completion_lps(raw["choices"][0]["logprobs"], ref)
    events = sse_events(post(server, "/v1/completions", {**body, "stream": True}))
    assert events[-1] == "[DONE]"
    merged: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for ev in events[:-1]:
        choice = ev["choices"][0]
        if choice["finish_reason"] is not None:  # OpenAI's type requires it; mid-stream chunks carry null
            Completion.model_validate(ev)
        if choice["logprobs"] is not None:
            Logprobs.model_validate(choice["logprobs"])
            for k in merged:
                merged[k] += choice["logprobs"][k]
    _check_completion_lps(merged, ref)

    ref_out = offline.chat(CHATS[0], sp, use_tqdm=False)[0].outputs[0]
    ref = _ref_steps(ref_out.logprobs, ref_out.token_ids)
    body = {"messages": CHATS[0], "max_tokens": 8, "temperature": 0, "logprobs": True, "top_logprobs": 3}
    raw = post(server, "/v1/chat/completions", body).json()
    ChatCompletion.model_validate(raw)
    _check_chat_lps(raw["choices"][0]["logprobs"]["content"], ref, 3)
    events = sse_events(post(server, "/v1/chat/completions", {**body, "stream": True}))
    content: list[dict[str, Any]] = []
    for ev in events[:-1]:
        ChatCompletionChunk.model_validate(ev)
        lp = ev["choices"][0]["logprobs"]
        content += lp["content"] if lp else []
    _check_chat_lps(content, ref, 3)


def test_echo_prompt_logprobs(server: ServerProcess, client: openai.OpenAI, offline) -> None:  # noqa: ANN001
    """echo + logprobs: the prompt's logprobs first (null for the first token), equal to offline's."""
    from pagedllm import SamplingParams
    from pagedllm.inputs import TokensPrompt

    ids = post(server, "/tokenize", {"prompt": PROMPTS[1]}).json()["tokens"]
    sp = SamplingParams(logprobs=2, prompt_logprobs=2, temperature=0.0, max_tokens=4)
    res = offline.generate(TokensPrompt(prompt_token_ids=ids), sp, use_tqdm=False)[0]
    plp = res.prompt_logprobs
    ref = _ref_steps(plp[1:], ids[1:]) + _ref_steps(res.outputs[0].logprobs, res.outputs[0].token_ids)
    body = {"prompt": PROMPTS[1], "max_tokens": 4, "temperature": 0, "logprobs": 2, "echo": True}
    for stream in (False, True):
        if stream:
            events = sse_events(post(server, "/v1/completions", {**body, "stream": True}))
            lp: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            for ev in events[:-1]:
                for k in lp:
                    lp[k] += (ev["choices"][0]["logprobs"] or {}).get(k, [])
        else:
            raw = post(server, "/v1/completions", body).json()
            assert raw["choices"][0]["text"] == PROMPTS[1] + res.outputs[0].text
            lp = raw["choices"][0]["logprobs"]
            # openai's type says List[float] although the API sends null first: validate the rest.
            trimmed = {**lp, "token_logprobs": lp["token_logprobs"][1:], "top_logprobs": lp["top_logprobs"][1:]}
            Completion.model_validate({**raw, "choices": [{**raw["choices"][0], "logprobs": trimmed}]})
        assert len(lp["tokens"]) == len(ids) + 4
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["text_offset"][0] == 0
        rest = {k: v[1:] for k, v in lp.items()}
        rest["text_offset"] = [o - lp["text_offset"][1] for o in rest["text_offset"]]
        _check_completion_lps(rest, ref)
    parsed = client.completions.create(
        model="smollm2", prompt=PROMPTS[1], max_tokens=4, temperature=0, logprobs=2, echo=True
    )  # the SDK accepts the null
    assert parsed.choices[0].logprobs is not None and parsed.choices[0].logprobs.token_logprobs[0] is None


def test_best_of(server: ServerProcess) -> None:
    """best_of=4, n=2: the 2 of the same 4 seeded samples with the highest cumulative logprob, best
    first; no logprobs unless asked; 400 for best_of < n, with stream, and in chat."""
    base = {"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 1.0, "seed": 11}
    samples = post(server, "/v1/completions", {**base, "n": 4, "logprobs": 0}).json()["choices"]
    ranked = sorted(samples, key=lambda c: -sum(c["logprobs"]["token_logprobs"]))
    raw = post(server, "/v1/completions", {**base, "n": 2, "best_of": 4, "logprobs": 0}).json()
    Completion.model_validate(raw)
    assert [c["index"] for c in raw["choices"]] == [0, 1]
    assert [c["text"] for c in raw["choices"]] == [c["text"] for c in ranked[:2]]
    assert raw["usage"]["completion_tokens"] == sum(len(c["logprobs"]["tokens"]) for c in samples)
    plain = post(server, "/v1/completions", {**base, "n": 2, "best_of": 4}).json()
    assert [c["text"] for c in plain["choices"]] == [c["text"] for c in ranked[:2]]
    assert all(c["logprobs"] is None for c in plain["choices"])
    bad = [
        ("/v1/completions", {**base, "n": 2, "best_of": 1}, "best_of"),
        ("/v1/completions", {**base, "best_of": 3, "stream": True}, "stream"),
        ("/v1/chat/completions", {"messages": CHATS[0], "best_of": 2}, "best_of"),
        ("/v1/chat/completions", {"messages": CHATS[0], "use_beam_search": True}, "use_beam_search"),
    ]
    for path, body, word in bad:
        resp = post(server, path, body)
        assert resp.status_code == 400 and word in resp.json()["error"]["message"], resp.text


def test_beam_search_matches_offline(server: ServerProcess, offline) -> None:  # noqa: ANN001
    """use_beam_search (best_of = beam width, n beams returned): the offline LLM.beam_search's beams."""
    from pagedllm import BeamSearchParams
    from pagedllm.inputs import TokensPrompt

    ids = post(server, "/tokenize", {"prompt": PROMPTS[0]}).json()["tokens"]
    ref = offline.beam_search(
        [TokensPrompt(prompt_token_ids=ids)], BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    )[0].sequences
    tok = offline.get_tokenizer()
    body = {
        "prompt": PROMPTS[0],
        "max_tokens": 6,
        "use_beam_search": True,
        "n": 2,
        "best_of": 3,
        "ignore_eos": True,
        "logprobs": 1,
    }
    raw = post(server, "/v1/completions", body).json()
    Completion.model_validate(raw)
    assert len(raw["choices"]) == 2
    for choice, beam in zip(raw["choices"], ref):
        assert choice["text"] == tok.decode(beam.tokens[len(ids) :], skip_special_tokens=True)
        assert abs(sum(choice["logprobs"]["token_logprobs"]) - beam.cum_logprob) <= LP_TOL
        assert all(1 <= len(t) <= 2 for t in choice["logprobs"]["top_logprobs"])
    events = sse_events(post(server, "/v1/completions", {**body, "stream": True, "logprobs": None}))
    texts = {ev["choices"][0]["index"]: ev["choices"][0]["text"] for ev in events[:-1]}
    assert texts == {i: c["text"] for i, c in enumerate(raw["choices"])}
    resp = post(server, "/v1/completions", {**body, "stop": ["\n"]})
    assert resp.status_code == 400 and "use_beam_search" in resp.json()["error"]["message"]


def test_image_part_on_text_only_model_is_400(client: openai.OpenAI) -> None:
    url = "data:image/png;base64,iVBORw0KGgo="
    msgs: Any = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=2)
    assert "text-only" in str(ei.value.body)
