"""`--reasoning-parser qwen3` end to end on a tiny random Qwen3 (character tokenizer with <think> / </think>,
a chat template that opens <think>): output containing </think> (forced with logit_bias) comes back split
into reasoning_content and content, streamed and not, exactly as the raw text splits; with
chat_template_kwargs enable_thinking=false (the prompt closes the think) everything is content."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")
import openai  # noqa: E402

from tests.entrypoints.openai.test_server import ServerProcess  # noqa: E402
from tests.entrypoints.openai.tiny_qwen3 import make_tiny_qwen3  # noqa: E402

MESSAGES: list[Any] = [{"role": "user", "content": "Is 7 prime?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3")))


@pytest.fixture(scope="module")
def tok(model_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def client(model_dir: str) -> Iterator[openai.OpenAI]:
    srv = ServerProcess(
        [
            model_dir,
            "--served-model-name",
            "q",
            "--reasoning-parser",
            "qwen3",
            "--dtype",
            "float32",
            "--max-model-len",
            "256",
            "--kv-cache-memory-bytes",
            str(16 << 20),
        ]
    )
    try:
        srv.wait_ready()
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)
    finally:
        srv.stop()


def chat(client: openai.OpenAI, stream: bool, **kw: Any) -> tuple[str | None, str | None]:
    """(reasoning_content, content) of one greedy chat completion, streamed or not."""
    args: dict[str, Any] = dict(model="q", messages=MESSAGES, max_tokens=24, temperature=0, **kw)
    if not stream:
        msg = client.chat.completions.create(**args).choices[0].message
        reasoning = getattr(msg, "reasoning_content", None)
        assert getattr(msg, "reasoning", None) == reasoning
        return reasoning, msg.content
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(**args, stream=True):
        for ch in chunk.choices:
            r = getattr(ch.delta, "reasoning_content", None)
            assert getattr(ch.delta, "reasoning", None) == r
            reasoning += r or ""
            content += ch.delta.content or ""
    return reasoning or None, content or None


def raw(client: openai.OpenAI, tok: Any, chat_template_kwargs: dict[str, Any] | None = None, **kw: Any) -> str:
    """The same generation without any parser: the prompt rendered here, sent to /v1/completions."""
    prompt = tok.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True, **(chat_template_kwargs or {})
    )
    res = client.completions.create(model="q", prompt=prompt, max_tokens=24, temperature=0, **kw)
    return res.choices[0].text


def test_think_end_splits_reasoning_and_content(client: openai.OpenAI, tok: Any) -> None:
    end = tok.convert_tokens_to_ids("</think>")
    # Only one letter and </think> can be sampled; the random model decides when it switches. Pick (by a
    # deterministic search) a letter for which it does so after some reasoning.
    seen = []
    for letter in "abcdefghijklmnopqrstuvwxyz":
        bias = {str(end): 100.0, str(tok.convert_tokens_to_ids(letter)): 100.0}
        text = raw(client, tok, logit_bias=bias)
        cut = text.find("</think>")
        if cut > 0:
            break
        seen.append(text)
    else:
        pytest.fail(f"no forced output holds </think> after some reasoning: {seen}")
    want = (text[:cut], text[cut + len("</think>") :] or None)
    assert chat(client, stream=False, logit_bias=bias) == want
    assert chat(client, stream=True, logit_bias=bias) == want


def test_thinking_disabled_is_all_content(client: openai.OpenAI, tok: Any) -> None:
    kwargs = {"enable_thinking": False}
    text = raw(client, tok, chat_template_kwargs=kwargs)
    assert text and "</think>" not in text
    for stream in (False, True):
        assert chat(client, stream=stream, extra_body={"chat_template_kwargs": kwargs}) == (None, text)
