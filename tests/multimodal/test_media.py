"""Image loading rules (`multimodal/media.py`): data URLs, file:// confined to the allowed directory
(symlinks and `..` resolved first), http(s) only from the allowed hosts."""

from __future__ import annotations

import base64
import io
import os

import pytest

from pagedllm.multimodal.media import MediaConnector
from tests.multimodal.tiny_vlm import random_image


def _png() -> bytes:
    buf = io.BytesIO()
    random_image(0, 9, 7).save(buf, format="PNG")
    return buf.getvalue()


def test_data_url_and_errors() -> None:
    mc = MediaConnector()
    img = mc.load_image("data:image/png;base64," + base64.b64encode(_png()).decode())
    assert img.size == (9, 7) and img.mode == "RGB"
    with pytest.raises(ValueError, match="not valid base64"):
        mc.load_image("data:image/png;base64,!!")
    with pytest.raises(ValueError, match="not an image"):
        mc.load_image("data:text/plain;base64,aGk=")
    with pytest.raises(ValueError, match="unsupported URL scheme"):
        mc.load_image("ftp://x/y.png")


def test_local_files_stay_inside_the_allowed_directory(tmp_path) -> None:  # noqa: ANN001
    allowed = tmp_path / "ok"
    allowed.mkdir()
    (allowed / "a.png").write_bytes(_png())
    (tmp_path / "secret.png").write_bytes(_png())
    os.symlink(tmp_path / "secret.png", allowed / "link.png")
    with pytest.raises(ValueError, match="allowed-local-media-path"):
        MediaConnector().load_image((allowed / "a.png").as_uri())
    mc = MediaConnector(str(allowed))
    assert mc.load_image((allowed / "a.png").as_uri()).size == (9, 7)
    for bad in (allowed / "link.png", allowed / ".." / "secret.png"):
        with pytest.raises(ValueError, match="outside"):
            mc.load_image("file://" + str(bad))


def test_http_needs_an_allowed_domain() -> None:
    with pytest.raises(ValueError, match="disabled"):
        MediaConnector().load_image("http://example.com/a.png")
    with pytest.raises(ValueError, match="'evil.com' is not in"):
        MediaConnector(allowed_media_domains=["example.com"]).load_image("https://evil.com/a.png")


def test_http_fetch_and_redirects_only_to_allowed_hosts() -> None:
    import http.server
    import threading

    png = _png()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            if self.path == "/img.png":
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.end_headers()
                self.wfile.write(png)
            else:  # a redirect to the same server under a host name that is not allowed
                self.send_response(302)
                self.send_header("Location", f"http://localhost:{self.server.server_address[1]}/img.png")
                self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        port = srv.server_address[1]
        mc = MediaConnector(allowed_media_domains=["127.0.0.1"])
        assert mc.load_image(f"http://127.0.0.1:{port}/img.png").size == (9, 7)
        with pytest.raises(ValueError, match="'localhost' is not in"):
            mc.load_image(f"http://127.0.0.1:{port}/redirect")
    finally:
        srv.shutdown()
