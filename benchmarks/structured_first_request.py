"""First-token latency of the first structured request an engine ever sees (a new JSON schema of common field
types), against a plain request, on the built-in SmolLM2 (issue 16, acceptance 5). Run it with
PAGEDLLM_STRUCTURED_WARMUP=0 and =1 in separate processes: without the warm-up the first schema pays for reading
the vocabulary into xgrammar and for its rules' token masks.

    python benchmarks/structured_first_request.py                      (the built-in SmolLM2)
    python benchmarks/structured_first_request.py --model benchmarks/workloads/qwen3-0.6b --tokenizer DIR
                                                                       (W1's shape, dummy weights)"""

from __future__ import annotations

import argparse
import time
import uuid

from pagedllm import LLM, SamplingParams
from pagedllm.sampling_params import StructuredOutputsParams

PROMPT = ["Describe a person as JSON."]


def user_schema() -> dict:
    """A schema nobody compiled before (a fresh property name), made of common field types."""
    k = "f" + uuid.uuid4().hex[:6]
    props = {
        k: {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "ok": {"type": "boolean"},
    }
    return {"type": "object", "properties": props, "required": [k, "age"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="a config directory (dummy weights); default: the built-in model")
    ap.add_argument("--tokenizer", default=None, help="with --model: the tokenizer directory")
    a = ap.parse_args()
    kw: dict = {}
    if a.model:
        kw = {"model": a.model, "tokenizer": a.tokenizer, "load_format": "dummy", "dtype": "bfloat16"}
    llm = LLM(disable_log_stats=True, max_model_len=512, **kw)
    time.sleep(4)  # the warm-up (if on) runs in a compile thread meanwhile

    def ttft(sp: SamplingParams) -> float:
        t = time.perf_counter()
        llm.generate(PROMPT, sp, use_tqdm=False)
        return (time.perf_counter() - t) * 1e3

    plain = SamplingParams(temperature=0, max_tokens=1)
    ttft(plain)
    p = min(ttft(plain) for _ in range(3))

    def structured() -> SamplingParams:
        return SamplingParams(
            temperature=0, max_tokens=1, structured_outputs=StructuredOutputsParams(json=user_schema())
        )

    first, second = ttft(structured()), ttft(structured())
    print(
        f"plain {p:.1f} ms; first-ever schema {first:.1f} ms (+{first - p:.1f}); "
        f"a second new schema {second:.1f} ms (+{second - p:.1f})"
    )


if __name__ == "__main__":
    main()
