"""Reading llama.cpp GGUF files (single or split `-0000i-of-0000N.gguf`) into a model.

Two ways: `gguf_weights_iterator` dequantizes every tensor to float32 with `gguf.quants.dequantize`
(`gguf_dequantize=True`), and `load_gguf_packed` keeps the linear layers' weights in their block formats
for the C kernels of `quantization/gguf.py` (the default on the CPU), dequantizing only the rest
(embedding, norms, and any linear weight of a type the kernels do not take). Tensors are renamed to their
HF checkpoint names. llama.cpp's converter permutes the rows of q/k projections of llama-architecture
models (to turn HF's rotate_half RoPE layout into its interleaved one); we undo that here, on the packed
rows too (a row's blocks move as a whole).
"""

from __future__ import annotations

import logging
import os
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


_SPLIT_RE = re.compile(r"^(.*)-(\d{5})-of-(\d{5})\.gguf$")


def gguf_files(path: str) -> list[str]:
    """The files of a GGUF checkpoint: `path` itself, or every shard of a split `-0000i-of-0000N.gguf`."""
    m = _SPLIT_RE.match(path)
    if m is None:
        return [path]
    prefix, _, total = m.groups()
    files = [f"{prefix}-{i:05d}-of-{total}.gguf" for i in range(1, int(total) + 1)]
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise ValueError(f"gguf: split checkpoint {path} is missing {', '.join(missing)}")
    return files


def open_gguf(path: str) -> Any:
    """`gguf.GGUFReader(path)`, with a clear error for a truncated or corrupt file."""
    import gguf

    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # noqa: BLE001 - numpy/struct errors of a short read become one clear error
        raise ValueError(f"gguf: cannot read {path}: truncated or not a GGUF file ({type(e).__name__}: {e})") from None


def _field_str(reader: Any, key: str) -> str | None:
    field = reader.fields.get(key)
    if field is None:
        return None
    if hasattr(field, "contents"):
        return str(field.contents())
    return bytes(field.parts[field.data[0]]).decode()


def gguf_architecture(path: str) -> str | None:
    return _field_str(open_gguf(gguf_files(path)[0]), "general.architecture")


def _hf_tensors(path: str, hf_config: Any) -> Iterator[tuple[str, Any, int | None]]:
    """(HF name, gguf tensor, heads to unpermute q/k rows by or None) for every tensor the model uses."""
    readers = [open_gguf(f) for f in gguf_files(path)]
    permute = _field_str(readers[0], "general.architecture") in PERMUTED_QK_ARCHS
    n_head = int(hf_config.num_attention_heads)
    n_kv_head = int(getattr(hf_config, "num_key_value_heads", None) or n_head)
    for reader in readers:
        for tensor in reader.tensors:
            hf_name = gguf_to_hf_name(tensor.name)
            if hf_name is None:
                if tensor.name.split(".")[0] not in _IGNORED:
                    logger.warning("gguf: ignoring tensor %s", tensor.name)
                continue
            heads = None
            if permute and ".self_attn.q_proj." in hf_name:
                heads = n_head
            elif permute and ".self_attn.k_proj." in hf_name:
                heads = n_kv_head
            yield hf_name, tensor, heads


def _dequantized(tensor: Any, heads: int | None) -> torch.Tensor:
    from gguf.quants import dequantize

    try:
        arr = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise ValueError(
            f"gguf: tensor {tensor.name} has type {tensor.tensor_type.name}, which pagedllm cannot load"
        ) from None
    # GGUF stores dims fastest-first; the HF (numpy) shape is the reverse.
    shape = tuple(int(d) for d in reversed(tensor.shape))
    if arr.shape != shape:
        arr = arr.reshape(shape)
    if heads is not None:
        arr = unpermute_qk(arr, heads)
    return torch.from_numpy(np.array(arr, dtype=np.float32, copy=True))


def gguf_weights_iterator(path: str, hf_config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (HF name, float32 tensor) for every tensor of the GGUF file the model uses."""
    for hf_name, tensor, heads in _hf_tensors(path, hf_config):
        yield hf_name, _dequantized(tensor, heads)
