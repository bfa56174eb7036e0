"""First-token latency of the first structured request an engine ever sees (a new JSON schema of common field
types), against a plain request, on the built-in SmolLM2 (issue 16, acceptance 5). Run it with
PAGEDLLM_STRUCTURED_WARMUP=0 and =1 in separate processes: without the warm-up the first schema pays for reading
the vocabulary into xgrammar and for its rules' token masks."""

from __future__ import annotations

import time
import uuid

from pagedllm import LLM, SamplingParams
from pagedllm.sampling_params import StructuredOutputsParams

llm = LLM(disable_log_stats=True, max_model_len=512)
time.sleep(4)  # the warm-up (if on) runs in a compile thread meanwhile


def ttft(sp: SamplingParams) -> float:
    t = time.perf_counter()
    llm.generate(["Describe a person as JSON."], sp, use_tqdm=False)
    return (time.perf_counter() - t) * 1e3


plain = SamplingParams(temperature=0, max_tokens=1)
ttft(plain)
p = [ttft(plain) for _ in range(3)]


def user_schema() -> dict:
    k = "f" + uuid.uuid4().hex[:6]
    return {
        "type": "object",
        "properties": {
            k: {"type": "string"},
            "age": {"type": "integer"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "ok": {"type": "boolean"},
        },
        "required": [k, "age"],
    }


first = ttft(
    SamplingParams(temperature=0, max_tokens=1, structured_outputs=StructuredOutputsParams(json=user_schema()))
)
second = ttft(
    SamplingParams(temperature=0, max_tokens=1, structured_outputs=StructuredOutputsParams(json=user_schema()))
)
print(
    f"plain {min(p):.1f} ms; first-ever schema {first:.1f} ms (+{first - min(p):.1f}); a second new schema {second:.1f} ms (+{second - min(p):.1f})"
)
