"""The structured-output warm-up (`StructuredOutputManager.warm_up`, `PAGEDLLM_STRUCTURED_WARMUP`): it builds
the backend and compiles the common JSON field types in a compile thread, without touching the GIL's switch
interval (that waits for a request that uses a grammar), and a request afterwards still gets valid JSON."""

from __future__ import annotations

import json
import sys

import pytest

xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.sampling_params import StructuredOutputsParams  # noqa: E402
from pagedllm.structured_output.backend import XgrammarBackend  # noqa: E402
from pagedllm.structured_output.config import StructuredOutputsConfig  # noqa: E402
from pagedllm.structured_output.manager import WARMUP_SCHEMAS, StructuredOutputManager  # noqa: E402
from pagedllm.transformers_utils.config import default_model_path  # noqa: E402
from pagedllm.transformers_utils.tokenizer import get_tokenizer  # noqa: E402


def test_warm_up_builds_the_backend_once_and_leaves_the_gil_interval() -> None:
    for schema in WARMUP_SCHEMAS:
        jsonschema.Draft202012Validator.check_schema(schema)
    tok = get_tokenizer(default_model_path())
    built = []

    def factory() -> XgrammarBackend:
        built.append(1)
        return XgrammarBackend(tok, len(tok), [tok.eos_token_id], StructuredOutputsConfig())

    mgr = StructuredOutputManager(StructuredOutputsConfig(), factory, len(tok))
    before = sys.getswitchinterval()
    try:
        mgr.warm_up().result(timeout=120)
        assert built == [1] and mgr._backend is not None
        assert sys.getswitchinterval() == before  # nothing constrained yet
        mgr._compile(StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "string"}}}))
        assert built == [1]  # the request reuses the warmed backend
    finally:
        sys.setswitchinterval(before)
        mgr.shutdown()


@pytest.mark.slow  # CI time (a SmolLM2 engine of its own): run by hand (pytest -m slow)
def test_engine_with_the_warm_up_serves_valid_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDLLM_STRUCTURED_WARMUP", "1")
    before = sys.getswitchinterval()
    llm = LLM(disable_log_stats=True, max_model_len=512)
    try:
        mgr = llm.llm_engine.engine_core.engine_core.scheduler.structured
        schema = {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
            "required": ["name", "age"],
            "additionalProperties": False,
        }
        sp = SamplingParams(temperature=0, max_tokens=48, structured_outputs=StructuredOutputsParams(json=schema))
        out = llm.generate(["Describe a person as JSON."], sp, use_tqdm=False)[0].outputs[0].text
        jsonschema.validate(json.loads(out), schema)
        assert mgr._backend is not None
    finally:
        sys.setswitchinterval(before)
