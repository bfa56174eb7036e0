"""Loading the tokenizer (from a HF directory, a hub id, or the metadata of a .gguf file)."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_TOKENIZER_MODES = ("auto", "hf", "slow")


def _resolve_gguf(tokenizer_name_or_path: str, gguf_file: str | None) -> tuple[str, str | None]:
    """(directory or hub id to load from, basename of the .gguf file or None)."""
    if tokenizer_name_or_path.endswith(".gguf") and os.path.isfile(tokenizer_name_or_path):
        path = os.path.abspath(tokenizer_name_or_path)
        return os.path.dirname(path), os.path.basename(path)
    if gguf_file is None:
        return tokenizer_name_or_path, None
    if os.path.dirname(gguf_file):
        # A path to the file: load from its own directory, whatever tokenizer_name_or_path says.
        path = os.path.abspath(gguf_file)
        return os.path.dirname(path), os.path.basename(path)
    return tokenizer_name_or_path, gguf_file


def get_tokenizer(
    tokenizer_name_or_path: str,
    *,
    gguf_file: str | None = None,
    tokenizer_mode: str = "auto",
    trust_remote_code: bool = False,
    revision: str | None = None,
) -> PreTrainedTokenizerBase:
    """Load (once per distinct set of arguments) the tokenizer of a model.

    `tokenizer_name_or_path` may be a directory, a hub id or a .gguf file; with `gguf_file` (a basename
    inside that directory, or a path) the tokenizer and its chat template are read from the GGUF
    metadata, which is how transformers supports GGUF. Pass `gguf_file` only when the tokenizer really
    comes from the GGUF file (not when a separate `--tokenizer` directory was given).

    The returned object is shared between callers: do not mutate it.
    """
    if tokenizer_mode not in _TOKENIZER_MODES:
        raise ValueError(
            f"tokenizer_mode: unknown value {tokenizer_mode!r}; expected one of {', '.join(_TOKENIZER_MODES)}"
        )
    if trust_remote_code:
        raise ValueError("trust_remote_code: not supported by pagedllm (custom tokenizer code is never run)")
    directory, gguf_name = _resolve_gguf(tokenizer_name_or_path, gguf_file)
    return _load_tokenizer(directory, gguf_name, tokenizer_mode, revision)


def model_tokenizer(model_config: Any) -> PreTrainedTokenizerBase:
    """The tokenizer of an engine's `ModelConfig`: its `tokenizer` path, or the model's own directory (and GGUF
    file, whose metadata then carries the tokenizer) when no separate tokenizer was given."""
    mc = model_config
    same = mc.tokenizer == mc.model
    return get_tokenizer(
        mc.model_dir if same else mc.tokenizer,
        gguf_file=mc.gguf_file if same else None,
        tokenizer_mode=mc.tokenizer_mode,
        revision=mc.revision,
    )


@functools.lru_cache(maxsize=8)
def _load_tokenizer(
    directory: str, gguf_name: str | None, tokenizer_mode: str, revision: str | None
) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    kwargs: dict[str, Any] = {"use_fast": tokenizer_mode != "slow"}
    if gguf_name is not None:
        kwargs["gguf_file"] = gguf_name
    if revision is not None:
        kwargs["revision"] = revision
    try:
        return AutoTokenizer.from_pretrained(directory, **kwargs)
    except (OSError, ValueError) as e:
        where = os.path.join(directory, gguf_name) if gguf_name else directory
        raise ValueError(f"tokenizer: could not load a tokenizer from {where!r} ({type(e).__name__}: {e})") from e


@dataclass(frozen=True)
class TokenizerInfo:
    """Tokenizer facts that are slow to query through transformers' properties, read once."""

    all_special_ids: frozenset[int]
    vocab_size: int
    """len(tokenizer): the base vocabulary plus added tokens (the largest valid id + 1)."""
    eos_token_id: int | None
    bos_token_id: int | None


_INFO_ATTR = "_pagedllm_tokenizer_info"


def get_cached_tokenizer_info(tokenizer: PreTrainedTokenizerBase) -> TokenizerInfo:
    """`TokenizerInfo` for `tokenizer`, computed on first use and stored on the tokenizer object."""
    info = getattr(tokenizer, _INFO_ATTR, None)
    if info is not None:
        return info
    info = TokenizerInfo(
        all_special_ids=frozenset(int(i) for i in tokenizer.all_special_ids),
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    try:
        setattr(tokenizer, _INFO_ATTR, info)
    except AttributeError:  # a tokenizer class with __slots__ or a read-only __setattr__
        pass
    return info
