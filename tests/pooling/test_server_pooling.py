"""`pagedllm serve` of all-MiniLM-L6-v2 through the official `openai` client (acceptance 1): the same
vectors as sentence-transformers, float and base64; the pooling routes and their 400s."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
import httpx  # noqa: E402

from tests.entrypoints.openai.test_server import ServerProcess  # noqa: E402
from tests.pooling.conftest import varied_sentences  # noqa: E402

TEXTS = varied_sentences(16, seed=3)


@pytest.fixture(scope="module")
def server(minilm_dir: str) -> Iterator[ServerProcess]:
    with ServerProcess([minilm_dir, "--served-model-name", "minilm", "--dtype", "float32"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Any:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none")


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def test_embeddings_float_and_base64_match_sentence_transformers(client: Any, st_model: Any) -> None:
    ref = st_model.encode(TEXTS, convert_to_numpy=True)
    resp = client.embeddings.create(model="minilm", input=TEXTS, encoding_format="float")
    got = np.array([d.embedding for d in sorted(resp.data, key=lambda d: d.index)], dtype=np.float32)
    assert got.shape == ref.shape
    assert _cos(got, ref).min() >= 0.9999
    assert resp.usage.prompt_tokens > len(TEXTS)
    # base64 asked for: little-endian float32 strings, the same floats.
    b64 = client.embeddings.create(model="minilm", input=TEXTS, encoding_format="base64")
    got64 = np.stack(
        [np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in sorted(b64.data, key=lambda d: d.index)]
    )
    np.testing.assert_allclose(got64, got, atol=1e-5, rtol=0)  # another step, maybe another batch
    # No format given: the client asks for base64 and decodes it itself.
    dflt = client.embeddings.create(model="minilm", input=TEXTS)
    np.testing.assert_allclose(np.array([d.embedding for d in dflt.data], dtype=np.float32), got, atol=1e-5, rtol=0)


def test_embeddings_token_ids_and_raw_base64(server: ServerProcess, client: Any, minilm_llm: Any) -> None:
    ids = minilm_llm.get_tokenizer()("token id input")["input_ids"]
    resp = client.embeddings.create(model="minilm", input=[ids], user="u1")
    ref = np.array(minilm_llm.embed(["token id input"])[0].outputs.embedding, dtype=np.float32)
    assert _cos(np.array(resp.data[0].embedding, dtype=np.float32), ref) >= 0.9999
    raw = httpx.post(
        server.url + "/v1/embeddings", json={"input": "token id input", "encoding_format": "base64"}
    ).json()
    vec = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert _cos(vec, ref) >= 0.9999


def test_score_rerank_and_models(server: ServerProcess, client: Any) -> None:
    url = server.url
    s = httpx.post(url + "/v1/score", json={"text_1": "a cat", "text_2": ["a kitten", "tax law"]}).json()
    assert [d["index"] for d in s["data"]] == [0, 1] and s["data"][0]["score"] > s["data"][1]["score"]
    assert httpx.post(url + "/score", json={"text_1": "a", "text_2": "b"}).status_code == 200
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        r = httpx.post(url + path, json={"query": "a cat", "documents": ["tax law", "a kitten"], "top_n": 1}).json()
        assert [x["index"] for x in r["results"]] == [1] and r["results"][0]["document"]["text"] == "a kitten"
    p = httpx.post(url + "/pooling", json={"input": "hello there", "task": "token_embed"}).json()
    assert len(p["data"][0]["data"][0]) == 384
    card = client.models.list().data[0]
    assert card.id == "minilm" and card.model_extra["task"] == "embed"


@pytest.mark.parametrize(
    ("path", "body", "needle"),
    [
        ("/v1/embeddings", {"input": []}, "input"),
        ("/v1/embeddings", {"input": "x", "dimensions": 8}, "dimensions"),
        ("/v1/embeddings", {"input": "word " * 400}, "maximum context length"),
        ("/classify", {"input": "x"}, "'classify'"),
        ("/v1/completions", {"model": "minilm", "prompt": "hi"}, "'generate'"),
        ("/v1/chat/completions", {"model": "minilm", "messages": [{"role": "user", "content": "hi"}]}, "'generate'"),
        ("/rerank", {"query": "q", "documents": []}, "documents"),
    ],
)
def test_bad_requests_are_400(server: ServerProcess, path: str, body: dict, needle: str) -> None:
    r = httpx.post(server.url + path, json=body)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


def test_truncate_prompt_tokens_over_http(server: ServerProcess) -> None:
    r = httpx.post(server.url + "/v1/embeddings", json={"input": "word " * 400, "truncate_prompt_tokens": 32})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 32
