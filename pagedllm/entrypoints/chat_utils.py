"""Chat conversations -> prompt text, through the model's (or a given) Jinja chat template."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

VALID_ROLES = ("system", "user", "assistant", "tool", "developer")

# Arguments of `apply_chat_template` itself: a chat_template_kwargs entry must not shadow them.
_RESERVED_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


def load_chat_template(path_or_str: str) -> str:
    """A chat template from a file path, or the template text itself.

    A string that names no existing file is taken as a template when it looks like Jinja (has "{" or a
    newline); otherwise it is reported as a missing file, the far likelier mistake.
    """
    if os.path.isfile(path_or_str):
        with open(path_or_str, encoding="utf-8") as f:
            return f.read()
    if "{" in path_or_str or "\n" in path_or_str:
        return path_or_str
    raise ValueError(f"chat_template: {path_or_str!r} is neither a readable file nor a Jinja template string")


def _content_to_text(content: Any, msg_index: int) -> str:
    if content is None:
        # e.g. an assistant message that only carries tool_calls; most templates concatenate strings
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[str] = []
        for j, part in enumerate(content):
            where = f"messages[{msg_index}].content[{j}]"
            if isinstance(part, str):
                texts.append(part)
                continue
            if not isinstance(part, dict):
                raise ValueError(f"{where}: expected a dict like {{'type': 'text', 'text': ...}}")
            ptype = part.get("type", "text")
            if ptype != "text":
                raise ValueError(f"{where}.type: only 'text' parts are supported, got {ptype!r}")
            text = part.get("text")
            if not isinstance(text, str):
                raise ValueError(f"{where}.text: expected a string, got {type(text).__name__}")
            texts.append(text)
        return "\n".join(texts)
    raise ValueError(
        f"messages[{msg_index}].content: expected a string, a list of text parts or None, got {type(content).__name__}"
    )


def normalize_conversation(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Validated copy of `conversation` with every message's content as one string."""
    if not isinstance(conversation, list) or not conversation:
        raise ValueError("messages: expected a non-empty list of messages")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(conversation):
        if not isinstance(msg, dict):
            raise ValueError(f"messages[{i}]: expected a dict with 'role' and 'content', got {type(msg).__name__}")
        role = msg.get("role")
        if role not in VALID_ROLES:
            raise ValueError(f"messages[{i}].role: expected one of {', '.join(VALID_ROLES)}, got {role!r}")
        new = dict(msg)
        new["content"] = _content_to_text(msg.get("content"), i)
        if isinstance(msg.get("tool_calls"), list):
            new["tool_calls"] = [_tool_call_for_template(tc, i, j) for j, tc in enumerate(msg["tool_calls"])]
        out.append(new)
    return out


def _tool_call_for_template(tc: Any, msg_index: int, call_index: int) -> Any:
    """An assistant message's tool call as chat templates expect it: OpenAI clients send `arguments` as
    JSON text, templates (Qwen's, Llama's: `tool_call.arguments | tojson`) want the object (as vLLM)."""
    if not isinstance(tc, dict) or not isinstance(tc.get("function"), dict):
        return tc
    args = tc["function"].get("arguments")
    if not isinstance(args, str):
        return tc
    try:
        parsed = json.loads(args)
    except (ValueError, RecursionError):
        raise ValueError(
            f"messages[{msg_index}].tool_calls[{call_index}].function.arguments: not valid JSON ({args[:64]!r})"
        ) from None
    return {**tc, "function": {**tc["function"], "arguments": parsed}}


def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase,
    conversation: list[dict[str, Any]],
    *,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """Render `conversation` into prompt text (not tokenized).

    `chat_template` (a file path or template text) overrides the tokenizer's own template.
    `continue_final_message` leaves the last message (usually an assistant prefix) open for the model;
    it cannot be combined with `add_generation_prompt`.
    """
    if add_generation_prompt and continue_final_message:
        raise ValueError(
            "add_generation_prompt, continue_final_message: only one may be true "
            "(continue_final_message continues the last message instead of starting a new one)"
        )
    messages = normalize_conversation(conversation)
    template = load_chat_template(chat_template) if chat_template is not None else None
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "chat_template: the tokenizer has no chat template and none was given; pass chat_template "
            "(a Jinja template string or a file path)"
        )
    extra = dict(chat_template_kwargs or {})
    clash = sorted(_RESERVED_KWARGS.intersection(extra))
    if clash:
        raise ValueError(f"chat_template_kwargs: {', '.join(clash)} cannot be set here")
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tools=tools,  # type: ignore[arg-type]
            chat_template=template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=False,
            return_dict=False,
            **extra,
        )
    except Exception as e:  # jinja2 errors (TemplateError, UndefinedError, TypeError in the template)
        if isinstance(e, ValueError) and str(e).startswith("chat_template"):
            raise
        raise ValueError(f"chat_template: rendering failed ({type(e).__name__}: {e})") from e
    if not isinstance(text, str):  # pragma: no cover - defensive against transformers API changes
        raise TypeError(f"apply_chat_template returned {type(text).__name__}, expected str")
    return text
