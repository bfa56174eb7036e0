"""Hostile input against a live server (issue 14, findings 1, 3, 4, 6, 7, 8, 9 and limits): each case was
a freeze, a 500, a silent coercion or an unbounded cost before; now a 400 (or 408/413) with an OpenAI
error body, and the server stays responsive."""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any

import httpx
import pytest

from tests.entrypoints.openai.test_server import ServerProcess
from tests.stress.conftest import BODY_TIMEOUT_S, HEADER_TIMEOUT_S, auth, metric, rss_bytes

CHAT = [{"role": "user", "content": "hi"}]
NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
BIG_STRING = "{{ 'x' * 500000000 }}"
HOSTILE: list[tuple[str, str, Any, str]] = [
    # (name, path, body (dict or raw bytes), field the 400 must name)
    ("seed_over_uint64", "/v1/completions", b'{"prompt": "hi", "seed": 18446744073709551616}', "seed"),
    ("seed_below_int64", "/v1/completions", b'{"prompt": "hi", "seed": -9223372036854775809}', "seed"),
    ("priority_2_70", "/v1/completions", b'{"prompt": "hi", "priority": 1180591620717411303424}', "priority"),
    ("stop_token_ids_1e20", "/v1/completions", b'{"prompt": "hi", "stop_token_ids": [100000000000000000000]}', "stop"),
    ("surrogate_prompt", "/v1/completions", b'{"prompt": "a\\ud800b"}', "prompt"),
    ("surrogate_chat", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages"),
    ("surrogate_tokenize", "/tokenize", b'{"prompt": "a\\ud800b"}', "prompt"),
    ("temperature_nan", "/v1/completions", b'{"prompt": "hi", "temperature": NaN}', "temperature"),
    ("temperature_inf", "/v1/completions", b'{"prompt": "hi", "temperature": Infinity}', "temperature"),
    ("top_p_nan", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "top_p": NaN}', "top_p"),
    ("n_true", "/v1/completions", {"prompt": "hi", "n": True}, "n"),
    ("max_tokens_string", "/v1/completions", {"prompt": "hi", "max_tokens": "16"}, "max_tokens"),
    ("prompt_bool_tokens", "/v1/completions", {"prompt": [[False]]}, "prompt"),
    ("message_not_object", "/v1/chat/completions", {"messages": ["hi"]}, "messages"),
    ("legacy_functions", "/v1/chat/completions", {"messages": CHAT, "functions": [{"name": "f"}]}, "functions"),
    ("n_over_max_n", "/v1/completions", {"prompt": "hi", "n": 17}, "n"),
    ("max_tokens_over_context", "/v1/completions", {"prompt": "hi", "max_tokens": 10**30}, "max_tokens"),
    ("ten_thousand_stops", "/v1/completions", {"prompt": "hi", "stop": [f"s{i}" for i in range(10_000)]}, "stop"),
    ("logit_bias_out_of_vocab", "/v1/completions", {"prompt": "hi", "logit_bias": {"99999999": 1}}, "logit_bias"),
    ("logit_bias_negative_id", "/v1/completions", {"prompt": "hi", "logit_bias": {"-1": 1}}, "logit_bias"),
    (
        "logit_bias_too_many",
        "/v1/completions",
        {"prompt": "hi", "logit_bias": {str(i): 1 for i in range(2000)}},
        "logit_bias",
    ),
    ("logit_bias_value", "/v1/completions", {"prompt": "hi", "logit_bias": {"5": 1000}}, "logit_bias"),
    ("logprobs_over_max", "/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    (
        "top_logprobs_over_max",
        "/v1/chat/completions",
        {"messages": CHAT, "logprobs": True, "top_logprobs": 21},
        "logprobs",
    ),
    ("deep_json", "/v1/completions", {"prompt": "hi", "user_data": json.loads("[" * 200 + "]" * 200)}, "user_data"),
    ("prompt_over_context", "/v1/completions", {"prompt": "hello " * 3000}, "prompt"),
    ("tokenize_over_context", "/tokenize", {"prompt": "hello " * 3000}, "prompt"),
    (
        "template_nested_loops",
        "/v1/chat/completions",
        {"messages": CHAT, "chat_template": NESTED_LOOPS},
        "chat_template",
    ),
    ("template_huge_string", "/v1/chat/completions", {"messages": CHAT, "chat_template": BIG_STRING}, "chat_template"),
    ("template_path", "/v1/chat/completions", {"messages": CHAT, "chat_template": "/etc/passwd"}, "chat_template"),
]


def post(server: ServerProcess, path: str, body: Any, timeout: float = 60) -> httpx.Response:
    headers = {**auth(), "Content-Type": "application/json"}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + path, content=content, headers=headers, timeout=timeout)


@pytest.mark.parametrize("name,path,body,param", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_input_gets_400(stress_server: ServerProcess, name: str, path: str, body: Any, param: str) -> None:
    resp = post(stress_server, path, body)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == 400
    assert param in (err["param"] or "") or param in err["message"], err


def test_hostile_templates_do_not_freeze_the_server(stress_server: ServerProcess) -> None:
    """Finding 1: while a hostile template renders, /health answers at once; the API process does not grow."""
    pid = stress_server.proc.pid
    post(stress_server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1, "chat_template": "{{ 'x' }}"})
    rss0 = rss_bytes(pid)
    results: dict[str, httpx.Response] = {}

    def hostile(name: str, template: str) -> None:
        results[name] = post(stress_server, "/v1/chat/completions", {"messages": CHAT, "chat_template": template})

    threads = [threading.Thread(target=hostile, args=(n, t)) for n, t in (("loops", NESTED_LOOPS), ("big", BIG_STRING))]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    health: list[float] = []
    while any(t.is_alive() for t in threads):
        s = time.monotonic()
        assert httpx.get(stress_server.url + "/health", timeout=10).status_code == 200
        health.append(time.monotonic() - s)
        time.sleep(0.1)
    for t in threads:
        t.join()
    assert max(health) < 1.0, health
    assert time.monotonic() - t0 < 30
    for r in results.values():
        assert r.status_code == 400 and "chat_template" in r.json()["error"]["message"], r.text
    assert rss_bytes(pid) < rss0 + (64 << 20)
    ok = post(
        stress_server,
        "/v1/chat/completions",
        {"messages": CHAT, "max_tokens": 2, "chat_template": "{{ messages[0].content }}"},
    )
    assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == 1


def _raw(server: ServerProcess) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    return s


def _read_response(s: socket.socket) -> tuple[int, dict[str, str], bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        assert chunk, data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    while len(body) < int(headers.get("content-length", 0)):
        body += s.recv(65536)
    return status, headers, body


def _request(path: str, body: bytes) -> bytes:
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {auth()['Authorization'][7:]}\r\n"
    return (head + f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body


def test_error_keeps_the_connection(stress_server: ServerProcess) -> None:
    """Finding 3: after an error the keep-alive connection still serves the next request."""
    with _raw(stress_server) as s:
        for body in (b'{"prompt": "a\\ud800b"}', b'{"prompt": [[false]]}', b'{"prompt": "hi", "max_tokens": 1}'):
            s.sendall(_request("/v1/completions", body))
            status, headers, _ = _read_response(s)
            assert headers.get("connection") != "close"
        assert status == 200


@pytest.mark.parametrize("partial", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConte"])
def test_slow_request_head_is_closed(stress_server: ServerProcess, partial: bytes) -> None:
    """Finding 8: a connection that sends nothing, or half a header, is closed after --timeout-request-header."""
    with _raw(stress_server) as s:
        s.sendall(partial)
        t0 = time.monotonic()
        assert s.recv(1024) == b""  # closed by the server
        assert time.monotonic() - t0 < HEADER_TIMEOUT_S + 3


def test_short_body_gets_408(stress_server: ServerProcess) -> None:
    """Finding 8: a body shorter than its Content-Length gets 408 after --timeout-request-body."""
    with _raw(stress_server) as s:
        full = _request("/v1/completions", b'{"prompt": "hi", "max_tokens": 1}' + b" " * 100)
        s.sendall(full[:-90])
        t0 = time.monotonic()
        status, _, body = _read_response(s)
        assert status == 408 and json.loads(body)["error"]["code"] == 408
        assert time.monotonic() - t0 < BODY_TIMEOUT_S + 3


def test_aborts_are_counted(stress_server: ServerProcess) -> None:
    """Finding 7: a client that disconnects mid-stream shows up as finished_reason="abort"."""
    before = metric(stress_server, "request_success_total", 'finished_reason="abort"')
    for _ in range(3):
        with (
            httpx.Client(timeout=60) as c,
            c.stream(
                "POST",
                stress_server.url + "/v1/completions",
                headers=auth(),
                json={"prompt": "Count:", "max_tokens": 500, "ignore_eos": True, "stream": True},
            ) as r,
        ):
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break
    deadline = time.monotonic() + 30
    while (
        time.monotonic() < deadline
        and metric(stress_server, "request_success_total", 'finished_reason="abort"') < before + 3
    ):
        time.sleep(0.2)
    assert metric(stress_server, "request_success_total", 'finished_reason="abort"') == before + 3


def test_openapi_documents_message_schema(stress_server: ServerProcess) -> None:
    """Finding 9: chat messages and their content parts are typed in the spec (fuzzers reach the model)."""
    spec = httpx.get(stress_server.url + "/openapi.json", headers=auth(), timeout=30).json()
    schemas = spec["components"]["schemas"]
    msg = schemas["ChatCompletionMessageParam"]
    assert set(msg["properties"]["role"]["enum"]) == {"system", "developer", "user", "assistant", "tool"}
    assert "ChatCompletionContentPartText" in schemas
    for path in ("/health", "/ping", "/metrics"):
        op = spec["paths"][path]["get"]
        assert "application/json" not in op["responses"]["200"].get("content", {}), (path, op)


def test_socket_reset_mid_sse(stress_server: ServerProcess) -> None:
    """Fault: the client's socket is reset (RST, not FIN) in the middle of an SSE stream: the request is
    aborted (counted), nothing stays running, and the server keeps serving."""
    import struct

    aborts = metric(stress_server, "request_success_total", 'finished_reason="abort"')
    body = json.dumps({"prompt": "Count:", "max_tokens": 500, "ignore_eos": True, "stream": True}).encode()
    s = _raw(stress_server)
    s.sendall(_request("/v1/completions", body))
    data = b""
    while b"data: {" not in data:
        data += s.recv(4096)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()  # linger 0: the kernel sends RST
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and metric(stress_server, "num_requests_running") > 0:
        time.sleep(0.2)
    assert metric(stress_server, "num_requests_running") == 0
    assert metric(stress_server, "request_success_total", 'finished_reason="abort"') == aborts + 1
    ok = post(stress_server, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200
