"""Structured-output fields of the OpenAI API -> `StructuredOutputsParams`.

Accepted, as vLLM: OpenAI's `response_format` ({"type": "text" | "json_object" | "json_schema", ...}),
vLLM's `structured_outputs` object, and the older `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar` (+ `guided_whitespace_pattern`). At most one of them; an invalid schema, regex or grammar
is a 400 naming the field the client used.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from pagedllm.sampling_params import StructuredOutputsParams

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


class StructuredOutputsRequestError(ValueError):
    """A bad structured-output field: `param` names it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _bad(param: str, msg: str) -> StructuredOutputsRequestError:
    return StructuredOutputsRequestError(f"{param}: {msg}", param)


def _from_response_format(rf: Any) -> StructuredOutputsParams | None:
    if not isinstance(rf, dict):
        raise _bad("response_format", "must be an object")
    if "type" not in rf:
        raise _bad("response_format.type", "field required ('text', 'json_object' or 'json_schema')")
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise _bad("response_format.json_schema", "must be an object with a 'schema'")
        schema = js.get("schema", js.get("json_schema"))
        if not isinstance(schema, (dict, str)):
            raise _bad("response_format.json_schema.schema", "must be a JSON schema object")
        return StructuredOutputsParams(json=schema)
    if kind == "structural_tag":
        tag = {k: v for k, v in rf.items() if k != "type"}
        return StructuredOutputsParams(structural_tag=json.dumps(rf if "format" in rf else tag))
    raise _bad("response_format.type", f"expected 'text', 'json_object' or 'json_schema', got {kind!r}")


def structured_outputs_from_request(req: Any) -> tuple[StructuredOutputsParams | None, str]:
    """(the request's constraint or None, the field it came from)."""
    extra = req.model_extra or {}
    given: list[tuple[str, Any]] = []
    rf = getattr(req, "response_format", None)
    if rf is None:
        rf = extra.get("response_format")
    if rf is not None:
        given.append(("response_format", rf))
    so = extra.get("structured_outputs")
    if so is not None:
        given.append(("structured_outputs", so))
    guided = [(name, extra[name]) for name in _GUIDED if extra.get(name) is not None]
    given.extend(guided)
    if not given:
        return None, ""
    active = [
        (n, v) for n, v in given if not (n == "response_format" and isinstance(v, dict) and v.get("type") == "text")
    ]
    if len(active) > 1:
        names = ", ".join(n for n, _ in active)
        raise _bad(active[1][0], f"only one structured-output field may be given, got {names}")
    if not active:
        return None, ""
    name, value = active[0]
    try:
        if name == "response_format":
            return _from_response_format(value), name
        if name == "structured_outputs":
            if not isinstance(value, dict):
                raise _bad(name, "must be an object")
            return msgspec.convert(value, StructuredOutputsParams), name
        kind = _GUIDED[name]
        kw: dict[str, Any] = {kind: value}
        ws = extra.get("guided_whitespace_pattern")
        if ws is not None:
            kw["whitespace_pattern"] = ws
        return msgspec.convert(kw, StructuredOutputsParams), name
    except StructuredOutputsRequestError:
        raise
    except (ValueError, TypeError, msgspec.ValidationError) as e:
        msg = str(e)
        if msg.startswith("structured_outputs: "):
            msg = msg[len("structured_outputs: ") :]
        raise _bad(name, msg) from None


def as_json_text(params: StructuredOutputsParams | None) -> StructuredOutputsParams | None:
    """A schema given as an object crosses to the engine as JSON text: a client's schema may hold values
    (integers beyond 64 bits) that the engine's msgpack transport cannot carry as objects."""
    if params is not None and isinstance(params.json, dict):
        params.json = json.dumps(params.json)
    return params


def field_for_error(source: str, params: StructuredOutputsParams) -> str:
    """The request field to name in a 400 about this constraint."""
    if source == "structured_outputs":
        return f"structured_outputs.{params.kind}"
    if source == "response_format" and params.kind == "json":
        return "response_format.json_schema.schema"
    return source


def check(params: StructuredOutputsParams, source: str) -> None:
    """The constraint parses: a StructuredOutputsRequestError naming the client's field otherwise."""
    from pagedllm.structured_output.backend import validate

    try:
        validate(params)
    except ValueError as e:
        field = field_for_error(source, params)
        msg = str(e).split(": ", 1)[1] if ": " in str(e) else str(e)
        raise _bad(field, msg) from None
