"""Structured outputs through `pagedllm serve`: OpenAI's response_format, vLLM's structured_outputs and the
older guided_* fields on /v1/completions and /v1/chat/completions (streamed and not), and 400s naming the
field for an invalid schema, regex or grammar."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("xgrammar")
import lark  # noqa: E402

from tests.entrypoints.openai.test_server import ENGINE_FLAGS, ServerProcess, post, sse_events  # noqa: E402
from tests.structured_output.cases import ARITH_EBNF, ARITH_LARK, REGEXES, SCHEMAS, check_json, fullmatch  # noqa: E402


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess(["--structured-outputs-config", '{"disable_any_whitespace": true}', *ENGINE_FLAGS]) as srv:
        yield srv


CHAT = [{"role": "user", "content": "Describe a person as JSON."}]


def chat(server: ServerProcess, stream: bool = False, finish: str = "stop", **body: Any) -> str:
    resp = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 160, "stream": stream, **body})
    assert resp.status_code == 200, resp.text
    if not stream:
        choice = resp.json()["choices"][0]
        assert choice["finish_reason"] == finish
        return choice["message"]["content"]
    events = [e for e in sse_events(resp) if e != "[DONE]"]
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events)


def completion(server: ServerProcess, prompt: str, stream: bool = False, **body: Any) -> str:
    resp = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 160, "stream": stream, **body})
    assert resp.status_code == 200, resp.text
    if not stream:
        choice = resp.json()["choices"][0]
        assert choice["finish_reason"] == "stop"
        return choice["text"]
    events = [e for e in sse_events(resp) if e != "[DONE]"]
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    return "".join(e["choices"][0]["text"] for e in events)


def test_response_format(server: ServerProcess) -> None:
    schema = SCHEMAS["person"]
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
    for stream in (False, True):
        check_json(chat(server, stream, response_format=rf, temperature=0.0), schema)
        check_json(completion(server, "A person as JSON:", stream, response_format=rf, temperature=1.0, seed=5), schema)
    obj = completion(server, "A JSON object (0):", response_format={"type": "json_object"}, temperature=0.0)
    assert isinstance(json.loads(obj), dict)
    assert chat(server, finish="length", response_format={"type": "text"}, max_tokens=8, temperature=0.0)


def test_structured_outputs_and_guided_fields(server: ServerProcess) -> None:
    weather = SCHEMAS["rating"]
    check_json(completion(server, "Rate a film:", structured_outputs={"json": weather}, temperature=0.0), weather)
    check_json(completion(server, "Rate a film:", True, guided_json=weather, temperature=1.0, seed=2), weather)
    date = completion(server, "Today's date:", structured_outputs={"regex": REGEXES["date"]}, temperature=1.0)
    assert fullmatch(REGEXES["date"], date), date
    phone = chat(server, True, guided_regex=REGEXES["phone"], temperature=1.0)
    assert fullmatch(REGEXES["phone"], phone), phone
    assert chat(server, guided_choice=["yes", "no"], temperature=1.0) in ("yes", "no")
    lark.Lark(ARITH_LARK, start="start").parse(completion(server, "Math:", guided_grammar=ARITH_EBNF))


BAD = [
    (
        "chat",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
        "response_format.json_schema.schema",
    ),
    ("chat", {"response_format": {"type": "xml"}}, "response_format.type"),
    ("completion", {"guided_regex": "(unclosed"}, "guided_regex"),
    ("completion", {"guided_json": "{not json"}, "guided_json"),
    ("completion", {"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs.grammar"),
    ("completion", {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ("chat", {"guided_grammar": "root ::= ("}, "guided_grammar"),
    ("chat", {"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice"),
]


@pytest.mark.parametrize("kind,body,param", BAD, ids=[b[2] + "-" + b[0] for b in BAD])
def test_bad_constraints_are_400_naming_the_field(server: ServerProcess, kind: str, body: dict, param: str) -> None:
    if kind == "chat":
        resp = post(server, "/v1/chat/completions", {"messages": CHAT, **body})
    else:
        resp = post(server, "/v1/completions", {"prompt": "x", **body})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param, err
    assert err["message"].startswith(param + ":"), err
