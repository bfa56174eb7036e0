"""Incremental detokenization and stop-string detection of one request's output.

Text is extended with the "prefix/read offset" technique: each step decodes a small window of ids,
`ids[prefix_offset:]`, and compares it with the decode of the already-emitted part of that window,
`ids[prefix_offset:read_offset]`; the difference is the new text. The window's left context gives BPE
merges and SentencePiece leading spaces the same result they have in a full decode. When the window's
text ends with U+FFFD, the last token(s) hold only part of a multi-byte UTF-8 character (emoji, CJK), so
nothing is emitted until a later token completes it (or the request finishes, where the full decode's
text is flushed as is).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from pagedllm.messages import EngineCoreRequest

_REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens used as left context for the first output tokens (a leading space or a BPE merge
# depends on what came before; a handful of tokens is plenty).
_PROMPT_CONTEXT_TOKENS = 6


def _make_decode_fn(
    tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool, spaces_between_special_tokens: bool
) -> Callable[[list[int]], str]:
    """A decode function equal to `tokenizer.decode(ids, skip_special_tokens=...)`.

    For fast tokenizers that do no clean-up, the Rust backend is called directly (several times faster
    than going through transformers' Python wrapper, and this runs twice per request per step).
    `spaces_between_special_tokens` only matters to slow (Python) tokenizers; fast ones ignore it, as in
    transformers and vLLM.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        backend_decode = backend.decode
        return lambda ids: backend_decode(ids, skip_special_tokens=skip_special_tokens)
    if getattr(tokenizer, "is_fast", False):
        return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)  # type: ignore[return-value]
    return lambda ids: tokenizer.decode(  # type: ignore[return-value]
        ids,
        skip_special_tokens=skip_special_tokens,
        spaces_between_special_tokens=spaces_between_special_tokens,
    )


class IncrementalDetokenizer:
    """Output token ids and text of one request, extended step by step.

    With `tokenizer=None` (skip_tokenizer_init) or `detokenize=False` only token ids are tracked and the
    text stays "".
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase | None,
        params: SamplingParams,
        prompt_token_ids: list[int] | None = None,
    ) -> None:
        self.token_ids: list[int] = []
        """All output token ids, including a stop token that is not part of the text."""
        self.output_text = ""
        self.stop: list[str] = list(params.stop or [])  # type: ignore[arg-type]
        self.min_tokens = params.min_tokens
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.stop_buffer_length = (
            max(len(s) for s in self.stop) - 1 if self.stop and not self.include_stop_str_in_output else 0
        )
        """Chars kept back from non-final outputs: they might turn out to be the start of a stop string
        that the final text will not contain."""
        self._last_output_text_offset = 0
        self.stop_string_hit: str | None = None
        self._decode: Callable[[list[int]], str] | None = None
        if tokenizer is not None and params.detokenize:
            self._decode = _make_decode_fn(tokenizer, params.skip_special_tokens, params.spaces_between_special_tokens)
        # Decoding window state: `_ids` = prompt context + the output ids that belong to the text.
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._emitted_past_read = 0
        """Chars past the decode of ids[prefix_offset:read_offset] already in the text (emitted while
        the window still ended in a partial character)."""
        if self._decode is not None and prompt_token_ids:
            context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
            # A prompt cut in the middle of a character would make the first output bytes complete a
            # prompt character; start without context then.
            if not self._decode(context).endswith(_REPLACEMENT_CHAR):
                self._ids = context
                self._read_offset = len(context)

    @classmethod
    def from_request(
        cls, tokenizer: PreTrainedTokenizerBase | None, request: EngineCoreRequest
    ) -> IncrementalDetokenizer:
        return cls(tokenizer, request.sampling_params, request.prompt_token_ids)

    @property
    def decodes(self) -> bool:
        """Whether `update` does more than collect token ids (text, stop strings)."""
        return self._decode is not None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)

    def update(self, new_token_ids: list[int], stop_terminated: bool, finished: bool = False) -> str | None:
        """Append the new tokens and extend the text; return the stop string if one was hit.

        `stop_terminated`: the core stopped on EOS or a stop token id, the last of `new_token_ids`; that
        token is kept in `token_ids` but not decoded unless `include_stop_str_in_output`.
        `finished`: the request ends with this update; text held back for an incomplete UTF-8 character
        is flushed so that the final text equals the full decode.
        On a stop-string hit the text is cut right before the stop string (right after it with
        `include_stop_str_in_output`); the caller must finish the request.
        """
        self.token_ids.extend(new_token_ids)
        if self._decode is None or self.stop_string_hit is not None:
            return None  # after a stop string the text is final
        to_decode = new_token_ids
        if stop_terminated and new_token_ids and not self.include_stop_str_in_output:
            to_decode = new_token_ids[:-1]
        len_before = len(self.output_text)
        self._ids.extend(to_decode)
        self._extend_text(flush=finished or stop_terminated)
        if not self.stop or len(self.token_ids) < self.min_tokens:
            return None
        return self._check_stop_strings(len(self.output_text) - len_before)

    def _extend_text(self, flush: bool) -> None:
        if self._read_offset == len(self._ids):
            return
        assert self._decode is not None
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        start = len(prefix_text) + self._emitted_past_read
        if flush or not new_text.endswith(_REPLACEMENT_CHAR):
            if len(new_text) > len(prefix_text):
                self.output_text += new_text[start:]
                self._prefix_offset = self._read_offset
                self._read_offset = len(self._ids)
                self._emitted_past_read = 0
        else:
            # Emit the complete characters before the trailing partial one now (a step may bring
            # several tokens); the offsets stay until the character is complete.
            stable = new_text.rstrip(_REPLACEMENT_CHAR)
            if len(stable) > start:
                self.output_text += stable[start:]
                self._emitted_past_read = len(stable) - len(prefix_text)

    def _check_stop_strings(self, new_char_count: int) -> str | None:
        """Find the stop string that completes first within the new text; cut the text there.

        Only the new chars plus the (len(stop) - 1) chars before them can contain a match that was not
        seen before, so only that tail is searched.
        """
        if new_char_count <= 0:
            return None
        text = self.output_text
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for stop_str in self.stop:
            start = max(0, len(text) - new_char_count - len(stop_str) + 1)
            idx = text.find(stop_str, start)
            if idx == -1:
                continue
            cand = (idx + len(stop_str), idx, stop_str)
            if best is None or cand[:2] < best[:2]:
                best = cand
        if best is None:
            return None
        end, start, stop_str = best
        self.output_text = text[:end] if self.include_stop_str_in_output else text[:start]
        self.stop_string_hit = stop_str
        return stop_str

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to put in the next output: all of it, or (delta) what was not returned before.

        Until the request finishes, the last `stop_buffer_length` chars are withheld so that a streamed
        output never shows the start of a stop string that is later cut away.
        """
        buffer = 0 if finished else self.stop_buffer_length
        end = len(self.output_text) - buffer
        if not delta:
            return self.output_text[:end] if buffer else self.output_text
        start = self._last_output_text_offset
        if start >= end:
            return ""
        self._last_output_text_offset = end
        return self.output_text[start:end]
