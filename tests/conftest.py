"""Shared pytest fixtures.

Keep this file small: add fixtures in clearly labelled sections.
"""

from __future__ import annotations

import pytest

# ---- Tokenizer fixtures (front end: detokenizer, output processor, chat utils) ----------------------


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """Path of the built-in SmolLM2-135M-Instruct GGUF (skips the test if it is not installed)."""
    from pagedllm.transformers_utils.config import default_model_path

    try:
        return default_model_path()
    except RuntimeError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path: str):  # noqa: ANN201 - a transformers tokenizer
    """The SmolLM2 tokenizer (with its chat template) read from the GGUF; loaded once per session."""
    from pagedllm.transformers_utils.tokenizer import get_tokenizer

    return get_tokenizer(smollm2_path)


# ---- SmolLM2 engine + HF reference fixtures (loaded once per session) ----------------------------

PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "The future of AI is",
    "Write a short poem about the sea.",
    "def fibonacci(n):",
    "List three colors:",
    "In 1492, Columbus",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Q: What is 2 + 2?\nA:",
    "Once upon a time, in a land far, far away, there lived a young princess who",
    "Translate to French: I love bread.",
    "The mitochondria is",
    "import numpy as np\nx = np.arange(10)\n",
    "My favourite food is",
    "Explain gravity to a child in one sentence:",
    "A haiku about autumn:",
    "The three laws of robotics are",
    "SELECT * FROM users WHERE",
    "Water boils at",
]
CHAT = [{"role": "user", "content": "Tell me a joke about cats."}]


def smollm2_prompts(tokenizer) -> list[list[int]]:  # noqa: ANN001 - a transformers tokenizer
    """20 prompts of mixed lengths as token ids (one chat-formatted: it holds id 2, SmolLM2's EOS/pad); also
    used by the benchmarks' bf16 reports."""
    ids = [tokenizer.encode(p) for p in PROMPTS]
    chat = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    ids.append(tokenizer.encode(chat, add_special_tokens=False))
    return ids


@pytest.fixture(scope="session")
def smollm2_prompt_ids(smollm2_tokenizer) -> list[list[int]]:  # noqa: ANN001
    return smollm2_prompts(smollm2_tokenizer)


@pytest.fixture(scope="session")
def smollm2_hf_model(smollm2_path: str):  # noqa: ANN201
    """HF transformers' own float32 SmolLM2 (same GGUF, dequantized by transformers)."""
    import os

    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(smollm2_path), gguf_file=os.path.basename(smollm2_path), dtype=torch.float32
    ).eval()


@pytest.fixture(scope="session")
def smollm2_hf_greedy(smollm2_hf_model, smollm2_prompt_ids) -> list[list[int]]:  # noqa: ANN001
    """HF greedy references, 48 tokens per prompt, one prompt at a time (computed once per session)."""
    from tests.hf_utils import hf_greedy

    return [hf_greedy(smollm2_hf_model, ids, 48) for ids in smollm2_prompt_ids]


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_path: str):  # noqa: ANN201
    """pagedllm's float32 SmolLM2 with default engine settings (shared by tests that don't change them), its
    GGUF weights dequantized at load as HF does (the packed path has its own tests: tests/model_executor)."""
    from pagedllm import LLM

    return LLM(smollm2_path, dtype="float32", max_model_len=2048, kv_cache_memory_bytes=256 << 20, gguf_dequantize=True)


# ---- Sampling surface (logprobs, seeds): an engine that chunks every prompt -----------------------


@pytest.fixture(scope="session")
def smollm2_llm_chunked(smollm2_path: str):  # noqa: ANN201
    """float32 SmolLM2 with a 16-token step budget (every prompt over 16 tokens is prefilled in chunks)
    and no logprobs limit (max_logprobs=-1, so logprobs=-1 is allowed)."""
    from pagedllm import LLM

    return LLM(
        smollm2_path,
        dtype="float32",
        max_model_len=512,
        kv_cache_memory_bytes=64 << 20,
        max_num_batched_tokens=16,
        max_logprobs=-1,
        gguf_dequantize=True,
    )
