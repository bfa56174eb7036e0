"""Malformed and extreme request inputs found by fuzzing the OpenAI server: each is a 4xx with an OpenAI-style
error body (it used to be a 500, or a 200 where vLLM answers 400), and none of them, nor a client leaving
mid-stream, disturbs the valid requests running beside them. Cases already covered by test_server.py's
BAD_INPUTS and test_protocol_strict.py are not repeated here."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from pydantic import ValidationError

pytest.importorskip("fastapi")
pytest.importorskip("xgrammar")
import httpx  # noqa: E402

from pagedllm.entrypoints.openai.protocol import INT64_MAX, ChatCompletionRequest, CompletionRequest  # noqa: E402
from pagedllm.entrypoints.openai.protocol_pooling import EmbeddingRequest  # noqa: E402
from pagedllm.entrypoints.openai.serving_base import OpenAIServing  # noqa: E402
from pagedllm.entrypoints.openai.structured_outputs import (  # noqa: E402
    StructuredOutputsRequestError,
    structured_outputs_from_request,
)
from pagedllm.logprobs import Logprob  # noqa: E402
from pagedllm.outputs import CompletionOutput  # noqa: E402
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402
from pagedllm.structured_output.backend import validate  # noqa: E402
from tests.entrypoints.openai.test_server import ENGINE_FLAGS, ServerProcess, post, sse_events  # noqa: E402

TOO_BIG = INT64_MAX + 1
"""Beyond int64: as `top_k` it killed the engine core before the fix ("Python int too large to convert to C
long" in its input batch: every later request got a 503); beyond 2**64 msgpack refused it (a 500)."""
MSG = [{"role": "user", "content": "hi"}]
EMPTY_LANGUAGE_SCHEMA = {"$ref": "#/definitions/a", "definitions": {"a": {"$ref": "#/definitions/a"}}}
LEGACY_TAG_BAD_SCHEMA = {
    "structures": [{"begin": "<a>", "schema": {"type": "nonsense"}, "end": "</a>"}],
    "triggers": ["<a"],
}


# ---- request models (no server) ------------------------------------------------------------------
@pytest.mark.parametrize("field", ["top_k", "n", "best_of", "logprobs", "min_tokens", "max_tokens"])
def test_completion_ints_beyond_int64_are_rejected(field: str) -> None:
    with pytest.raises(ValidationError, match=field):
        CompletionRequest.model_validate({"prompt": "x", field: TOO_BIG})
    CompletionRequest.model_validate({"prompt": "x", field: 1})


@pytest.mark.parametrize("field", ["top_k", "n", "max_tokens", "max_completion_tokens", "min_tokens"])
def test_chat_ints_beyond_int64_are_rejected(field: str) -> None:
    with pytest.raises(ValidationError, match=field):
        ChatCompletionRequest.model_validate({"messages": MSG, field: TOO_BIG})


def test_pooling_priority_beyond_int64_is_rejected() -> None:
    with pytest.raises(ValidationError, match="priority"):
        EmbeddingRequest.model_validate({"input": "x", "priority": TOO_BIG})


def test_stop_token_ids_checked_against_vocab() -> None:
    params = SamplingParams(stop_token_ids=[5, 100], min_tokens=1)
    params.verify_against_vocab(101, 20)
    with pytest.raises(ValueError, match="stop_token_ids: token id 100 is out of the vocabulary"):
        params.verify_against_vocab(100, 20)


@pytest.mark.parametrize(
    "body,ok",
    [
        ({"top_logprobs": 3}, False),  # needs logprobs=true (vLLM)
        ({"top_logprobs": -1}, False),
        ({"top_logprobs": 3, "logprobs": False}, False),
        ({"top_logprobs": -2, "logprobs": True}, False),
        ({"top_logprobs": TOO_BIG, "logprobs": True}, False),
        ({"top_logprobs": 0}, True),
        ({"top_logprobs": 3, "logprobs": True}, True),
        ({"top_logprobs": -1, "logprobs": True}, True),
    ],
)
def test_chat_top_logprobs_checked_as_vllm(body: dict[str, Any], ok: bool) -> None:
    if ok:
        ChatCompletionRequest.model_validate({"messages": MSG, **body})
    else:
        with pytest.raises(ValidationError, match="top_logprobs"):
            ChatCompletionRequest.model_validate({"messages": MSG, **body})


def test_chat_logprobs_top_minus_one_keeps_all() -> None:
    """top_logprobs=-1 (the whole distribution the engine returned) must not drop the last entry."""
    pos = {t: Logprob(-float(t), rank=t, decoded_token=f"t{t}") for t in (1, 2, 3)}
    out = CompletionOutput(index=0, text="t1", token_ids=[1], logprobs=[pos])
    serving = OpenAIServing.__new__(OpenAIServing)
    content = serving.chat_logprobs(out, -1).content  # type: ignore[union-attr]
    assert content is not None and [t.token for t in content[0].top_logprobs] == ["t1", "t2", "t3"]
    assert len(serving.chat_logprobs(out, 2).content[0].top_logprobs) == 2  # type: ignore[union-attr]


def test_response_format_needs_a_type() -> None:
    req = ChatCompletionRequest.model_validate({"messages": MSG, "response_format": {}})
    with pytest.raises(StructuredOutputsRequestError) as info:
        structured_outputs_from_request(req)
    assert info.value.param == "response_format.type"
    req = ChatCompletionRequest.model_validate({"messages": MSG, "response_format": {"type": "text"}})
    assert structured_outputs_from_request(req) == (None, "")


@pytest.mark.parametrize(
    "params",
    [
        {"json": json.dumps(EMPTY_LANGUAGE_SCHEMA)},
        {"regex": r"[^\s\S]"},
        {"grammar": r"root ::= [^\x00-\U0010FFFF]"},
    ],
    ids=["json_ref_loop", "regex", "grammar"],
)
def test_constraint_matching_nothing_is_invalid(params: dict[str, Any]) -> None:
    """Its requests would fail at their first token (the grammar allows none): a 500 before the fix. (xgrammar
    0.2.9 refuses the `$ref` loop itself; 0.2.8 compiles it, and the emptiness check catches it.)"""
    with pytest.raises(
        ValueError, match=r": invalid (JSON schema|regex|EBNF grammar): (no text can match it|Circular)"
    ):
        validate(StructuredOutputsParams(**params))


@pytest.mark.parametrize("params", [{"regex": ""}, {"choice": [""]}, {"regex": "é+"}, {"json": '{"type": "object"}'}])
def test_constraints_matching_something_stay_valid(params: dict[str, Any]) -> None:
    validate(StructuredOutputsParams(**params))


@pytest.mark.parametrize(
    "tag",
    [LEGACY_TAG_BAD_SCHEMA, {"structures": [{"begin": "<a>", "schema": {}, "end": "</a>"}], "triggers": [5]}],
    ids=["bad_schema", "bad_trigger"],
)
def test_legacy_structural_tag_is_validated(tag: dict[str, Any]) -> None:
    """The older {"structures", "triggers"} form was only compiled in the engine (a 500 there)."""
    with pytest.raises(ValueError, match="structured_outputs.structural_tag: invalid structural_tag"):
        validate(StructuredOutputsParams(structural_tag=json.dumps(tag)))


# ---- through the server --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess(ENGINE_FLAGS) as srv:
        yield srv


SERVER_BAD_INPUTS: list[tuple[str, str, dict[str, Any], int, str]] = [
    # (name, path, body, status, param): each was a 500, a dead engine, or a 200 where vLLM gives 400
    ("top_k_beyond_int64", "/v1/completions", {"prompt": "x", "top_k": TOO_BIG}, 400, "top_k"),
    (
        "stop_token_id_out_of_vocab_with_min_tokens",  # min_tokens masked it in the logits: engine IndexError
        "/v1/completions",
        {"prompt": "x", "max_tokens": 2, "min_tokens": 1, "stop_token_ids": [10**6]},
        400,
        "stop_token_ids",
    ),
    (
        "schema_matching_nothing",
        "/v1/completions",
        {"prompt": "x", "max_tokens": 2, "structured_outputs": {"json": EMPTY_LANGUAGE_SCHEMA}},
        400,
        "structured_outputs.json",
    ),
    (
        "regex_matching_nothing",
        "/v1/chat/completions",
        {"messages": MSG, "max_tokens": 2, "guided_regex": r"[^\s\S]"},
        400,
        "guided_regex",
    ),
    (
        "legacy_structural_tag_bad_schema",
        "/v1/completions",
        {"prompt": "x", "max_tokens": 2, "structured_outputs": {"structural_tag": json.dumps(LEGACY_TAG_BAD_SCHEMA)}},
        400,
        "structured_outputs.structural_tag",
    ),
    (
        "beam_search_with_structured_outputs",  # was a 200 whose output ignored the constraint
        "/v1/completions",
        {"prompt": "x", "use_beam_search": True, "best_of": 2, "structured_outputs": {"choice": ["a"]}},
        400,
        "structured_outputs",
    ),
    (
        "top_logprobs_without_logprobs",
        "/v1/chat/completions",
        {"messages": MSG, "max_tokens": 2, "top_logprobs": 3},
        400,
        "top_logprobs",
    ),
    (
        "response_format_without_type",
        "/v1/chat/completions",
        {"messages": MSG, "max_tokens": 2, "response_format": {}},
        400,
        "response_format.type",
    ),
]


@pytest.mark.parametrize("name,path,body,status,param", SERVER_BAD_INPUTS, ids=[b[0] for b in SERVER_BAD_INPUTS])
def test_bad_inputs_are_4xx(server: ServerProcess, name: str, path: str, body: Any, status: int, param: str) -> None:
    resp = post(server, path, body)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and err["type"] == "BadRequestError" and err["param"] == param, err
    assert "Traceback" not in server.read_log()


RAW_BAD_BODIES = [
    b'{"prompt": "x", "temperature": 1e999}',
    b'{"prompt": "x", "logit_bias": {"1": -1e999}}',
    b'{"prompt": "x", "top_k": 1180591620717411303424}',
    b'{"prompt": "x", "max_tokens": 2, "structured_outputs": {"regex": "[^\\\\s\\\\S]"}}',
    b'{"prompt": [99999999]}',
    b"[",
    b"",
    b"[1, 2]",
    b'{"prompt": "\\ud800"}',
]


def test_bad_inputs_and_disconnects_beside_valid_streams(server: ServerProcess) -> None:
    """Valid streams run to their end while bad requests arrive and other clients leave mid-stream; the
    engine then has nothing left running and still serves."""
    valid = {
        "prompt": "Count:",
        "max_tokens": 48,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    results: dict[str, Any] = {}

    def stream(i: int) -> None:
        resp = httpx.post(server.url + "/v1/completions", json=valid, timeout=300)
        events = sse_events(resp)
        usage = events[-2]["usage"] if len(events) >= 2 and isinstance(events[-2], dict) else None
        results[f"stream{i}"] = (resp.status_code, events[-1], usage and usage["completion_tokens"])

    def leave_early() -> None:
        body = {**valid, "n": 3}
        with httpx.Client(timeout=300) as c, c.stream("POST", server.url + "/v1/completions", json=body) as r:
            for k, _ in enumerate(r.iter_lines()):
                if k >= 2:
                    break

    def bad() -> None:
        statuses = []
        for raw in RAW_BAD_BODIES * 2:
            resp = post(server, "/v1/completions", content=raw)
            statuses.append(resp.status_code)
        results["bad"] = statuses

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
    threads += [threading.Thread(target=leave_early) for _ in range(2)] + [threading.Thread(target=bad)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for i in range(3):
        status, last, n = results[f"stream{i}"]
        assert status == 200 and last == "[DONE]" and n == 48, results[f"stream{i}"]
    assert results["bad"] and all(s == 400 for s in results["bad"]), results["bad"]
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    ok = post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 4})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
    assert "Traceback" not in server.read_log()
