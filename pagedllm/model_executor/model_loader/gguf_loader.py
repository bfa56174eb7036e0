"""Reading llama.cpp GGUF files as HF-named float tensors.

Every tensor is dequantized to float32 with `gguf.quants.dequantize` and renamed to its HF checkpoint
name. llama.cpp's converter permutes the rows of q/k projections of llama-architecture models (to turn
HF's rotate_half RoPE layout into its interleaved one); we undo that here.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

# GGUF architectures whose q/k rows llama.cpp's converter permutes.
PERMUTED_QK_ARCHS = frozenset({"llama"})

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Present in some files but recomputed from the config (llama3 rope factors).
_IGNORED = frozenset({"rope_freqs"})
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def gguf_to_hf_name(name: str) -> str | None:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'; None for tensors we don't use."""
    m = _BLOCK_RE.match(name)
    if m:
        layer, kind, suffix = m.groups()
        hf = _BLOCK_NAMES.get(kind)
        return None if hf is None else f"model.layers.{layer}.{hf}.{suffix}"
    base, _, suffix = name.rpartition(".")
    if base in _GLOBAL_NAMES and suffix in ("weight", "bias"):
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    return None


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's permute:
    `w.reshape(n_head, 2, rows // n_head // 2, *rest).swapaxes(1, 2).reshape(w.shape)`."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field_str(reader: Any, key: str) -> str | None:
    field = reader.fields.get(key)
    if field is None:
        return None
    if hasattr(field, "contents"):
        return str(field.contents())
    return bytes(field.parts[field.data[0]]).decode()


def gguf_architecture(path: str) -> str | None:
    import gguf

    return _field_str(gguf.GGUFReader(path), "general.architecture")


def gguf_weights_iterator(path: str, hf_config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (HF name, float32 tensor) for every tensor of the GGUF file the model uses."""
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(path)
    arch = _field_str(reader, "general.architecture")
    permute = arch in PERMUTED_QK_ARCHS
    n_head = int(hf_config.num_attention_heads)
    n_kv_head = int(getattr(hf_config, "num_key_value_heads", None) or n_head)
    for tensor in reader.tensors:
        hf_name = gguf_to_hf_name(tensor.name)
        if hf_name is None:
            if tensor.name.split(".")[0] not in _IGNORED:
                logger.warning("gguf: ignoring tensor %s", tensor.name)
            continue
        arr = dequantize(tensor.data, tensor.tensor_type)
        # GGUF stores dims fastest-first; the HF (numpy) shape is the reverse.
        shape = tuple(int(d) for d in reversed(tensor.shape))
        if arr.shape != shape:
            arr = arr.reshape(shape)
        if permute and ".self_attn.q_proj." in hf_name:
            arr = unpermute_qk(arr, n_head)
        elif permute and ".self_attn.k_proj." in hf_name:
            arr = unpermute_qk(arr, n_kv_head)
        yield hf_name, torch.from_numpy(np.array(arr, dtype=np.float32, copy=True))
