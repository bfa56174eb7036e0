"""Applying an update atomically: every tensor is first checked (name and shape) against a copy of the
model on the meta device, through the model's own `load_weights` and weight loaders (fused / sharded
parameters, checkpoint naming); only when all pass are the real parameters written, in place (CUDA graphs
keep pointing at them). A bad name or shape raises a ValueError naming the tensor and changes nothing.

CPU models whose linear weights are prepacked for oneDNN (`cpu_gemm`) get the touched layers unpacked
first (exactly: packed(I) = W^T) and packed again afterwards.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from pagedllm.model_executor.model_loader.weight_utils import default_weight_loader

_SILENTLY_SKIPPED = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
"""Checkpoint names the models ignore on purpose (as at start-up)."""


def validate_update(meta_model: nn.Module, weights: Sequence[tuple[str, torch.Tensor]]) -> set[str]:
    """Dry-run of `load_weights` on `meta_model`; returns the names of the parameters the update touches."""
    calls: list[str] = []
    params = dict(meta_model.named_parameters())
    saved: dict[str, Any] = {}
    for pname, p in params.items():
        orig = getattr(p, "weight_loader", None)
        saved[pname] = orig
        loader = orig or default_weight_loader

        def record(param: Any, t: torch.Tensor, *a: Any, _l: Callable = loader, _n: str = pname) -> None:
            calls.append(_n)
            _l(param, t, *a)

        p.weight_loader = record  # type: ignore[attr-defined]
    tied = bool(getattr(meta_model, "tie_word_embeddings", False))
    try:
        for name, tensor in weights:
            before = len(calls)
            try:
                meta_model.load_weights([(name, tensor.to("meta"))])  # type: ignore[operator]
            except (ValueError, RuntimeError, AssertionError) as e:
                raise ValueError(f"update_weights: tensor {name!r}: {e}") from None
            if len(calls) == before:
                if any(s in name for s in _SILENTLY_SKIPPED) or (tied and name.startswith("lm_head.")):
                    continue
                raise ValueError(f"update_weights: tensor {name!r}: no such weight in the model")
    finally:
        for pname, p in params.items():
            if saved[pname] is None:
                del p.weight_loader  # type: ignore[attr-defined]
            else:
                p.weight_loader = saved[pname]  # type: ignore[attr-defined]
    return set(calls)


def _packable_modules(model: nn.Module) -> list[tuple[nn.Module, bool]]:
    """(module, release plain weight after packing) for the layers `pack_cpu_weights` packs."""
    from pagedllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
    from pagedllm.model_executor.layers.vocab_embedding import ParallelLMHead

    embeddings = {id(m.weight) for m in model.modules() if type(m).__name__ == "VocabParallelEmbedding"}
    out = []
    for m in model.modules():
        if isinstance(m, LinearBase) and isinstance(getattr(m, "quant_method", None), UnquantizedLinearMethod):
            out.append((m, True))
        elif isinstance(m, ParallelLMHead):
            out.append((m, id(m.weight) not in embeddings))  # type: ignore[arg-type]
    return out  # type: ignore[return-value]


def unpack_weight(module: nn.Module) -> None:
    """Restore a packed layer's plain [out, in] weight from its oneDNN-packed copy (bit-exact: I @ W^T)."""
    from pagedllm.model_executor.layers.cpu_gemm import packed_linear

    packed = module.packed_weight
    n_in, n_out = module.packed_in_features, module.packed_out_features
    eye = torch.eye(n_in, dtype=module.weight.dtype)  # type: ignore[call-overload]
    module.weight.data = packed_linear(eye, packed, None, n_out).t().contiguous()  # type: ignore[arg-type]


def validate_internal(meta_model: nn.Module, weights: Sequence[tuple[str, torch.Tensor]]) -> set[str]:
    """`is_checkpoint_format=False`: names are the model's own parameter names, shapes must match exactly."""
    params = dict(meta_model.named_parameters(remove_duplicate=False))
    for name, tensor in weights:
        if name not in params:
            raise ValueError(f"update_weights: tensor {name!r}: no such parameter in the model")
        if tuple(tensor.shape) != tuple(params[name].shape):
            raise ValueError(
                f"update_weights: tensor {name!r}: shape {tuple(tensor.shape)} does not match the parameter's "
                f"{tuple(params[name].shape)}"
            )
    return {n for n, _ in weights}


def apply_weight_update(
    model: nn.Module,
    meta_model: nn.Module,
    weights: Sequence[tuple[str, torch.Tensor]],
    checkpoint_format: bool = True,
) -> int:
    """Check then load `weights` into `model` (HF checkpoint names through the weight loaders, or the model's
    own parameter names with `checkpoint_format=False`); returns how many parameters changed."""
    from pagedllm.model_executor.layers.cpu_gemm import pack_module

    if checkpoint_format:
        touched_names = validate_update(meta_model, weights)
    else:
        touched_names = validate_internal(meta_model, weights)
    params = dict(model.named_parameters(remove_duplicate=False))
    touched = {id(params[n]) for n in touched_names if n in params}
    if getattr(model, "tie_word_embeddings", False) and "model.embed_tokens.weight" in touched_names:
        touched.add(id(params["model.embed_tokens.weight"]))
    packable = [(m, rel) for m, rel in _packable_modules(model) if id(m.weight) in touched]
    # Repacked in the dtype they were packed in (bf16 GEMMs of a float32 encoder: pooling/cpu_mixed.py).
    packed_dtypes: dict[int, torch.dtype] = {
        id(m): m.packed_weight.dtype  # type: ignore[union-attr,misc]
        for m, _ in packable
        if getattr(m, "packed_weight", None) is not None
    }
    for m, _ in packable:
        if getattr(m, "packed_weight", None) is not None and m.weight.numel() == 0:  # type: ignore[operator]
            unpack_weight(m)
    with torch.no_grad():
        if checkpoint_format:
            model.load_weights(weights)  # type: ignore[operator]
        else:
            for name, tensor in weights:
                params[name].data.copy_(tensor)
        for m, release in packable:
            if m.weight.device.type == "cpu":
                m.packed_weight = None  # type: ignore[assignment]
                pack_module(m, release=release, dtype=packed_dtypes.get(id(m)))
    return len(touched)
