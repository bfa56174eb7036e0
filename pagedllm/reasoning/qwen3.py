"""`qwen3`: `<think>...</think>` then the answer. An output without `</think>` is all content (Qwen3 with
thinking switched off). When the chat template opened `<think>` in the prompt, the server feeds the parser
the output as if it began with the tag, so text up to `</think>` is reasoning.

Streaming decides before the end: after `<think>` text streams as reasoning, otherwise as content. An
output cut off inside its reasoning therefore streams as reasoning but is content when not streamed
(as vLLM)."""

from __future__ import annotations

from pagedllm.reasoning.base import register_reasoning_parser
from pagedllm.reasoning.think_tags import ThinkTagReasoningParser, held_back


@register_reasoning_parser("qwen3")
class Qwen3ReasoningParser(ThinkTagReasoningParser):
    def split(self, text: str, final: bool) -> tuple[str | None, str | None]:
        if final:
            before, sep, after = text.partition(self.start_token)
            body = after if sep else before
            parts = self._after_end(body, final)
            return parts if parts is not None else (None, body)
        if self.start_token.startswith(text):
            return None, None  # may still become the start tag
        if not text.startswith(self.start_token):
            return None, text
        body = text[len(self.start_token) :]
        parts = self._after_end(body, final)
        if parts is not None:
            return parts
        return body[: len(body) - held_back(body, self.end_token)], None
