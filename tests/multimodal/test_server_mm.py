"""Images through `pagedllm serve` with the official `openai` client, on the tiny LLaVA and Gemma 3 checkpoints: a
base64 image gives the same text as offline `LLM.chat`; http(s) URLs are fetched (from a local
http.server) only from --allowed-media-domains; file:// only under --allowed-local-media-path; bad input
is a 400 naming the problem."""

from __future__ import annotations

import base64
import functools
import http.server
import io
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from tests.entrypoints.openai.test_server import ServerProcess  # noqa: E402
from tests.multimodal.tiny_vlm import make_tiny_gemma3, make_tiny_llava, random_image  # noqa: E402

FLAGS = ["--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory-bytes", str(16 << 20)]
FLAGS += ["--limit-mm-per-prompt", '{"image": 2}']
FAMILIES = {"llava": (make_tiny_llava, 8), "gemma3": (make_tiny_gemma3, 20)}
"""Builder and step token budget (LLaVA's images split across chunks; Gemma 3's are kept whole: 16 tokens)."""


def _png(img: Any) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> dict[str, Any]:  # noqa: ANN001
    root = tmp_path_factory.mktemp("media")
    allowed = root / "allowed"
    allowed.mkdir()
    img = random_image(7, 60, 45)
    (allowed / "cat.png").write_bytes(_png(img))
    (root / "secret.png").write_bytes(_png(img))
    (allowed / "broken.png").write_bytes(b"\x89PNG not really")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(allowed))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield {"root": root, "allowed": allowed, "img": img, "port": httpd.server_address[1]}
    httpd.shutdown()


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request) -> str:  # noqa: ANN001
    return str(request.param)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, family: str) -> str:  # noqa: ANN001
    path = tmp_path_factory.mktemp(f"{family}_srv")
    FAMILIES[family][0](path)
    return str(path)


@pytest.fixture(scope="module")
def server(model_dir: str, family: str, media: dict[str, Any]) -> Iterator[ServerProcess]:
    with ServerProcess(
        [
            model_dir,
            "--served-model-name",
            "llava",
            "--allowed-local-media-path",
            str(media["allowed"]),
            "--allowed-media-domains",
            "127.0.0.1",
            *FLAGS,
            "--max-num-batched-tokens",
            str(FAMILIES[family][1]),
        ]
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Any:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _messages(url: str, text: str = "w4 w5 w6") -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]}
    ]


def _chat(client: Any, messages: list[dict[str, Any]]) -> str:
    r = client.chat.completions.create(model="llava", messages=messages, max_tokens=8, temperature=0.0)
    return r.choices[0].message.content


def _bad(client: Any, messages: list[dict[str, Any]]) -> str:
    with pytest.raises(openai.BadRequestError) as ei:
        _chat(client, messages)
    assert ei.value.status_code == 400
    return json.dumps(ei.value.body)


def test_base64_image_equals_offline(client: Any, model_dir: str, family: str, media: dict[str, Any]) -> None:
    from pagedllm import LLM, SamplingParams

    url = "data:image/png;base64," + base64.b64encode(_png(media["img"])).decode()
    served = _chat(client, _messages(url))
    budget = FAMILIES[family][1]
    llm = LLM(
        model_dir, dtype="float32", max_model_len=256, kv_cache_memory_bytes=8 << 20, max_num_batched_tokens=budget
    )
    offline = llm.chat(_messages(url), SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0]
    assert served == offline.outputs[0].text
    assert len(offline.outputs[0].token_ids) == 8
    # The same image over http (allowed domain) and file:// (allowed path): the same answer.
    assert _chat(client, _messages(f"http://127.0.0.1:{media['port']}/cat.png")) == served
    assert _chat(client, _messages((media["allowed"] / "cat.png").as_uri())) == served


def test_media_sources_outside_the_allow_lists_are_400(client: Any, media: dict[str, Any]) -> None:
    body = _bad(client, _messages(f"http://localhost:{media['port']}/cat.png"))
    assert "allowed-media-domains" in body and "localhost" in body
    body = _bad(client, _messages((media["root"] / "secret.png").as_uri()))
    assert "outside --allowed-local-media-path" in body
    body = _bad(client, _messages((media["allowed"] / "missing.png").as_uri()))
    assert "no such file" in body
    body = _bad(client, _messages(f"http://127.0.0.1:{media['port']}/missing.png"))
    assert "HTTP 404" in body


def test_bad_images_are_400_and_the_server_keeps_serving(client: Any, media: dict[str, Any]) -> None:
    assert "unreadable image" in _bad(client, _messages((media["allowed"] / "broken.png").as_uri()))
    assert "base64" in _bad(client, _messages("data:image/png;base64,@@@"))
    url = (media["allowed"] / "cat.png").as_uri()
    three = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}] * 3}]
    assert "limit_mm_per_prompt" in _bad(client, three)
    assert len(_chat(client, _messages(url)).split()) > 0
