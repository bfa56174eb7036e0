"""Chat messages with OpenAI-style image parts: each `image_url` (or offline `image_pil`) part becomes the
model's image placeholder text in the message (the processor expands it later), and its image is loaded.
Placeholders go where the parts were, so any chat template that takes string contents renders them."""

from __future__ import annotations

from typing import Any

from pagedllm.multimodal.media import MediaConnector, to_image

IMAGE_PART_TYPES = ("image_url", "image_pil")


def has_images(conversation: Any) -> bool:
    if not isinstance(conversation, list):
        return False
    return any(
        isinstance(m, dict)
        and isinstance(m.get("content"), list)
        and any(isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES for p in m["content"])
        for m in conversation
    )


def split_image_parts(conversation: list[dict[str, Any]], placeholder: str) -> tuple[list[dict[str, Any]], list[Any]]:
    """(the conversation with image parts as placeholder text parts, the parts' sources in order: URL strings
    or PIL images). Nothing is loaded yet."""
    out: list[dict[str, Any]] = []
    sources: list[Any] = []
    for i, msg in enumerate(conversation):
        content = msg.get("content") if isinstance(msg, dict) else None
        if not isinstance(content, list):
            out.append(msg)
            continue
        parts = []
        for j, part in enumerate(content):
            ptype = part.get("type") if isinstance(part, dict) else None
            where = f"messages[{i}].content[{j}]"
            if ptype == "image_url":
                iu = part.get("image_url")
                url = iu.get("url") if isinstance(iu, dict) else iu
                if not isinstance(url, str):
                    raise ValueError(f"{where}.image_url.url: expected a string")
                sources.append(url)
            elif ptype == "image_pil":
                sources.append(part.get("image_pil"))
            else:
                parts.append(part)
                continue
            parts.append({"type": "text", "text": placeholder})
        out.append({**msg, "content": parts})
    return out, sources


def load_images(sources: list[Any], connector: MediaConnector) -> list[Any]:
    images = []
    for k, src in enumerate(sources):
        where = f"image {k} (image_url)"
        images.append(connector.load_image(src, where) if isinstance(src, str) else to_image(src, where))
    return images
