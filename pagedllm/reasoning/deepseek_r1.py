"""`deepseek_r1`: everything up to `</think>` is reasoning. The `<think>` start tag is optional (R1's chat
template puts it in the prompt); an output that never closes the reasoning is all reasoning."""

from __future__ import annotations

from pagedllm.reasoning.base import register_reasoning_parser
from pagedllm.reasoning.think_tags import ThinkTagReasoningParser, held_back


@register_reasoning_parser("deepseek_r1")
class DeepSeekR1ReasoningParser(ThinkTagReasoningParser):
    def split(self, text: str, final: bool) -> tuple[str | None, str | None]:
        if not final and self.start_token.startswith(text):
            return None, None  # may still become the start tag
        if text.startswith(self.start_token):
            text = text[len(self.start_token) :]
        parts = self._after_end(text, final)
        if parts is not None:
            return parts
        if final:
            return text, None
        return text[: len(text) - held_back(text, self.end_token)], None
