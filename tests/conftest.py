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
