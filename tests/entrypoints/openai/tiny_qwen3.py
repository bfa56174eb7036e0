"""A tiny random Qwen3 checkpoint with a character-level tokenizer that has `<think>` / `</think>` tokens and
a Qwen3-style chat template (opens `<think>` unless `enable_thinking` is false), for reasoning tests."""

from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = (
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}{%- endif %}"
)


def make_tiny_qwen3(out_dir: str | Path) -> Path:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import AddedToken, PreTrainedTokenizerFast

    from tests.utils_model import make_tiny_hf_model

    chars = ["<unk>", "\n", *[chr(i) for i in range(32, 127)]]
    backend = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", eos_token="<|im_end|>", clean_up_tokenization_spaces=False
    )
    tok.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tok.chat_template = CHAT_TEMPLATE
    out = Path(out_dir)
    make_tiny_hf_model(
        "qwen3", out, overrides={"vocab_size": len(tok), "eos_token_id": tok.eos_token_id, "bos_token_id": None}
    )
    tok.save_pretrained(str(out))
    return out
