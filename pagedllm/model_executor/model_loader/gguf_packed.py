"""Loading a GGUF checkpoint with its linear weights kept packed (`quantization="gguf"`, the default: the C
kernels on the CPU, the Triton kernels of `quantization.gguf_triton` on CUDA).

Every linear layer (q/k/v, o, gate/up, down, the LM head) whose source tensors all have a type the C
kernels take (`quantization.gguf.PACKED_TYPES`) gets the file's blocks as its weight; the sub-weights of a
fused layer are stacked by rows in the layer's shard order. Everything else (the embedding, the norms, a
linear weight stored as F16/F32 or in a type without a kernel) is dequantized and loaded as today.
A tied LM head (no `output.weight`) multiplies with the packed `token_embd` blocks, while the embedding
lookup keeps a dequantized copy.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
from torch import nn

from pagedllm.model_executor.layers.linear import LinearBase
from pagedllm.model_executor.layers.quantization import gguf as gguf_q
from pagedllm.model_executor.layers.vocab_embedding import ParallelLMHead
from pagedllm.model_executor.model_loader.gguf_loader import _dequantized, _hf_tensors, unpermute_qk

logger = logging.getLogger(__name__)

# HF sub-projection -> (fused layer attribute, its place in the layer's output rows).
_FUSED = {
    ".q_proj": (".qkv_proj", 0),
    ".k_proj": (".qkv_proj", 1),
    ".v_proj": (".qkv_proj", 2),
    ".gate_proj": (".gate_up_proj", 0),
    ".up_proj": (".gate_up_proj", 1),
}
_N_SHARDS = {".qkv_proj": 3, ".gate_up_proj": 2}


def _target(hf_name: str, modules: dict[str, nn.Module]) -> tuple[str, int, int] | None:
    """(layer name, shard index, shard count) of the linear layer an HF weight name feeds, or None."""
    if not hf_name.endswith(".weight"):
        return None
    base = hf_name[: -len(".weight")]
    for hf, (fused, idx) in _FUSED.items():
        if base.endswith(hf):
            name = base[: -len(hf)] + fused
            return (name, idx, _N_SHARDS[fused]) if isinstance(modules.get(name), LinearBase) else None
    layer = modules.get(base)
    if (isinstance(layer, LinearBase) or isinstance(layer, ParallelLMHead)) and getattr(layer, "tp_size", 1) == 1:
        return base, 0, 1
    return None


def _packed(tensor: Any, heads: int | None) -> gguf_q.GGUFWeight:
    rows, cols = int(tensor.shape[1]), int(tensor.shape[0])  # GGUF dims are fastest-first
    data = np.asarray(tensor.data).reshape(rows, -1)
    if data.shape[1] != gguf_q.row_bytes(int(tensor.tensor_type), cols):
        raise ValueError(f"gguf: tensor {tensor.name} has {data.shape[1]} bytes per row, expected another size")
    if heads is not None:
        data = unpermute_qk(data, heads)
    return gguf_q.GGUFWeight(int(tensor.tensor_type), torch.from_numpy(np.array(data, copy=True)), rows, cols)


def _stack(parts: list[gguf_q.GGUFWeight]) -> list[gguf_q.GGUFWeight]:
    """Adjacent parts of one type become one (one kernel call per type run)."""
    out: list[gguf_q.GGUFWeight] = []
    for p in parts:
        if out and out[-1].qtype == p.qtype and out[-1].cols == p.cols:
            last = out[-1]
            out[-1] = gguf_q.GGUFWeight(p.qtype, torch.cat([last.data, p.data]), last.rows + p.rows, p.cols)
        else:
            out.append(p)
    return out


def _packable(tensor: Any) -> bool:
    qtype = int(tensor.tensor_type)
    qk = gguf_q._BLOCK.get(qtype, (0, 0))[0]
    return len(tensor.shape) == 2 and qtype in gguf_q.PACKED_TYPES and int(tensor.shape[0]) % qk == 0


def load_gguf_packed(model: nn.Module, path: str, hf_config: Any, device: torch.device | str = "cpu") -> set[str]:
    """Loads the GGUF checkpoint at `path` into `model`, packed where the kernels allow; returns the names
    of the parameters loaded (as `model.load_weights` does). On CUDA the packed weights are re-laid for
    the Triton kernels (`gguf_triton.prepare`) as they go to the device."""
    on_gpu = torch.device(device).type == "cuda"
    modules = dict(model.named_modules())
    entries = list(_hf_tensors(path, hf_config))
    tied = bool(getattr(hf_config, "tie_word_embeddings", False)) or not any(
        n == "lm_head.weight" for n, _, _ in entries
    )
    # Which layers every source tensor of is packable.
    sources: dict[str, list[tuple[int, int, Any, int | None]]] = {}
    for hf_name, tensor, heads in entries:
        if tied and hf_name == "lm_head.weight":
            continue
        tgt = _target("lm_head.weight" if hf_name == "model.embed_tokens.weight" and tied else hf_name, modules)
        if tgt is not None:
            sources.setdefault(tgt[0], []).append((tgt[1], tgt[2], tensor, heads))
    packed_layers = {
        name for name, src in sources.items() if len(src) == src[0][1] and all(_packable(t) for _, _, t, _ in src)
    }
    loaded: set[str] = set()
    nbytes = 0
    for name in sorted(packed_layers):
        src = sorted(sources[name], key=lambda s: s[0])
        parts = _stack([_packed(t, heads) for _, _, t, heads in src])
        if on_gpu:
            from pagedllm.model_executor.layers.quantization.gguf_triton import prepare

            parts = [prepare(p, device) for p in parts]
        else:
            parts = [gguf_q.tile(p) for p in parts]  # the AVX-512 VNNI kernel's layout, where it runs
        nbytes += sum(p.nbytes for p in parts)
        layer = modules[name]
        if name == "lm_head":
            layer.gguf_weight = parts  # compute_logits multiplies with these
            if not tied:
                layer.weight.data = torch.empty(0, dtype=layer.weight.dtype, device=layer.weight.device)  # not read
                loaded.add("lm_head.weight")
        else:
            gguf_q.install(layer, parts)
    # The rest: dequantized, through the model's own loader (embedding, norms, biases, unpacked layers).
    dense_skip = {n for n in packed_layers if n != "lm_head"}

    def dense() -> Any:
        for hf_name, tensor, heads in entries:
            tgt = _target(hf_name, modules)
            if tgt is not None and tgt[0] in dense_skip:
                continue
            if hf_name == "lm_head.weight" and "lm_head" in packed_layers:
                continue
            yield hf_name, _dequantized(tensor, heads)

    loaded |= model.load_weights(dense())  # type: ignore[operator]
    kinds = sorted({p.type_name for n in packed_layers for p in _parts_of(modules[n])})
    logger.info(
        "gguf: %d linear layers packed (%s, %.1f MB, %s kernels); %d dequantized",
        len(packed_layers),
        ", ".join(kinds),
        nbytes / 1e6,
        "Triton" if on_gpu else gguf_q.isa_name(),
        len(sources) - len(packed_layers),
    )
    if not on_gpu and isinstance(getattr(model, "model", None), nn.Module):
        from pagedllm.model_executor.layers.quantization.gguf_decode_stack import maybe_attach

        maybe_attach(model.model)  # type: ignore[arg-type]
    return loaded


def _parts_of(layer: nn.Module) -> list[gguf_q.GGUFWeight]:
    qm = getattr(layer, "quant_method", None)
    if isinstance(qm, gguf_q.GGUFLinearMethod):
        return qm.parts
    return list(getattr(layer, "gguf_weight", None) or [])
