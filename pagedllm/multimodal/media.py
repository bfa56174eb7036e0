"""Loading images from what users send: PIL images (offline), `data:` URLs, `file://` paths under
`allowed_local_media_path`, and http(s) URLs whose host is in `allowed_media_domains` (fetched here)."""

from __future__ import annotations

import base64
import binascii
import io
import os
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

MAX_IMAGE_BYTES = 32 << 20
"""Largest encoded image accepted (data URL, file or download)."""


def image_from_bytes(data: bytes, where: str) -> Any:
    """A decoded RGB PIL image; ValueError naming `where` if the bytes are not a readable image."""
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(data))
        img.load()
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise ValueError(f"{where}: unreadable image ({type(e).__name__}: {e})") from None
    return img.convert("RGB") if img.mode != "RGB" else img


def to_image(item: Any, where: str) -> Any:
    """An offline `multi_modal_data["image"]` item (a PIL image, or bytes) as an RGB PIL image."""
    from PIL import Image

    if isinstance(item, Image.Image):
        return item.convert("RGB") if item.mode != "RGB" else item
    if isinstance(item, (bytes, bytearray)):
        return image_from_bytes(bytes(item), where)
    raise ValueError(f"{where}: expected a PIL.Image.Image, got {type(item).__name__}")


class _SameDomainRedirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to an allowed host (else the allow-list could be bypassed)."""

    def __init__(self, connector: MediaConnector, where: str) -> None:
        self.connector, self.where = connector, where

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001, ANN201, PLR0913
        self.connector.check_domain(newurl, self.where)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


class MediaConnector:
    def __init__(
        self,
        allowed_local_media_path: str = "",
        allowed_media_domains: list[str] | None = None,
        timeout: float = 10.0,
    ) -> None:
        self.allowed_local_media_path = os.path.realpath(allowed_local_media_path) if allowed_local_media_path else ""
        self.allowed_media_domains = [d.lower() for d in allowed_media_domains or []]
        self.timeout = timeout

    def load_image(self, url: str, where: str = "image_url") -> Any:
        if not isinstance(url, str) or not url:
            raise ValueError(f"{where}: expected a URL string")
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            return image_from_bytes(self._data_url(url, where), where)
        if scheme == "file":
            return image_from_bytes(self._local_file(url, where), where)
        if scheme in ("http", "https"):
            return image_from_bytes(self._fetch(url, where), where)
        raise ValueError(f"{where}: unsupported URL scheme {scheme!r} (expected data:, file:// or http(s)://)")

    @staticmethod
    def _data_url(url: str, where: str) -> bytes:
        head, sep, payload = url.partition(",")
        if not sep or not head.endswith(";base64"):
            raise ValueError(f"{where}: expected a base64 data URL (data:image/...;base64,...)")
        mime = head[5:].split(";", 1)[0]
        if mime and not mime.startswith("image/"):
            raise ValueError(f"{where}: data URL media type {mime!r} is not an image")
        if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
            raise ValueError(f"{where}: image larger than {MAX_IMAGE_BYTES} bytes")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError(f"{where}: the data URL is not valid base64") from None

    def _local_file(self, url: str, where: str) -> bytes:
        if not self.allowed_local_media_path:
            raise ValueError(f"{where}: file:// URLs are disabled (start the server with --allowed-local-media-path)")
        parsed = urllib.parse.urlparse(url)
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"{where}: file:// URLs must name a local path, got host {parsed.netloc!r}")
        path = os.path.realpath(urllib.parse.unquote(parsed.path))
        root = self.allowed_local_media_path
        if os.path.commonpath([path, root]) != root:
            raise ValueError(f"{where}: the file {path!r} is outside --allowed-local-media-path ({root})")
        if not os.path.isfile(path):
            raise ValueError(f"{where}: no such file {path!r}")
        if os.path.getsize(path) > MAX_IMAGE_BYTES:
            raise ValueError(f"{where}: image larger than {MAX_IMAGE_BYTES} bytes")
        with open(path, "rb") as f:
            return f.read()

    def check_domain(self, url: str, where: str) -> None:
        host = (urllib.parse.urlparse(url).hostname or "").lower()
        if not self.allowed_media_domains:
            raise ValueError(
                f"{where}: http(s) image URLs are disabled (start the server with --allowed-media-domains)"
            )
        if host not in self.allowed_media_domains:
            allowed = ", ".join(self.allowed_media_domains)
            raise ValueError(f"{where}: the domain {host!r} is not in --allowed-media-domains ({allowed})")

    def _fetch(self, url: str, where: str) -> bytes:
        self.check_domain(url, where)
        opener = urllib.request.build_opener(_SameDomainRedirects(self, where))
        try:
            with opener.open(
                urllib.request.Request(url, headers={"User-Agent": "pagedllm"}), timeout=self.timeout
            ) as r:
                data = r.read(MAX_IMAGE_BYTES + 1)
        except urllib.error.HTTPError as e:
            raise ValueError(f"{where}: fetching {url} failed with HTTP {e.code}") from None
        except (urllib.error.URLError, OSError) as e:
            raise ValueError(f"{where}: fetching {url} failed ({e})") from None
        if len(data) > MAX_IMAGE_BYTES:
            raise ValueError(f"{where}: image larger than {MAX_IMAGE_BYTES} bytes")
        return data
