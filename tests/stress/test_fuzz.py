"""Fuzz (issue 14, acceptance 2): schemathesis cases generated from the server's own /openapi.json for
every operation (valid and invalid bodies), each checked for: no 5xx, an answer within the timeout (no
hang), the documented content type and a body matching the documented schema. The CI smoke runs
`SMOKE_CASES` per operation; the slow version at least 2,000 in all."""

from __future__ import annotations

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import content_type_conformance, response_schema_conformance  # noqa: E402

from tests.entrypoints.openai.test_server import ServerProcess  # noqa: E402
from tests.stress.conftest import auth  # noqa: E402

SMOKE_CASES = 8
CHECKS = [not_a_server_error, content_type_conformance, response_schema_conformance]


def fuzz(server: ServerProcess, cases_per_mode: int) -> dict[str, int]:
    """Run the cases; returns the number of calls per operation."""
    spec = httpx.get(server.url + "/openapi.json", headers=auth(), timeout=30).json()
    schema = schemathesis.openapi.from_dict(spec)
    counts: dict[str, int] = {}
    for result in schema.get_all_operations():
        op = result.ok()
        label = f"{op.method.upper()} {op.path}"
        counts[label] = 0
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @settings(
                max_examples=cases_per_mode,
                deadline=None,
                database=None,
                phases=[Phase.generate],
                suppress_health_check=list(HealthCheck),
            )
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case: schemathesis.Case) -> None:
                # Keep generations short: the fuzz is about the HTTP layer, not about decoding speed.
                # (chat's max_tokens defaults to the rest of the context: thousands of tokens on a CPU).
                if isinstance(case.body, dict) and case.path in ("/v1/completions", "/v1/chat/completions"):
                    keys = ("max_tokens", "max_completion_tokens")
                    for key in keys:
                        if isinstance(case.body.get(key), int) and case.body[key] > 8:
                            case.body[key] = 8
                    if all(case.body.get(k) is None for k in keys):
                        case.body["max_tokens"] = 8
                response = case.call(base_url=server.url, headers=auth(), timeout=60)
                counts[label] += 1  # noqa: B023 - run() is called right here, in this iteration
                case.validate_response(response, checks=CHECKS)

            try:
                run()
            except Unsatisfiable:
                assert mode is GenerationMode.NEGATIVE  # no parameters or body: nothing invalid to send
    return counts


def test_fuzz_smoke(stress_server: ServerProcess) -> None:
    counts = fuzz(stress_server, SMOKE_CASES)
    assert len(counts) >= 9 and all(n > 0 for n in counts.values()), counts


@pytest.mark.slow
def test_fuzz_2000_cases(stress_server: ServerProcess) -> None:
    counts = fuzz(stress_server, 300)  # operations without a body exhaust their few cases early
    assert sum(counts.values()) >= 2000 and all(n > 0 for n in counts.values()), counts
