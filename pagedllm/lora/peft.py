"""Reading PEFT LoRA adapters (`adapter_config.json` + `adapter_model.safetensors`, or `adapter_model.bin`).

`check_adapter` validates an adapter cheaply (its config and the tensor shapes in the safetensors header)
against the base model's config; `load_adapter` reads the weights as `LoRAAdapter`: per module of OUR model
(`model.layers.0.self_attn.qkv_proj`), per output slice of that module (q/k/v, gate/up), A [r, in] and B
[out, r] with the scaling (lora_alpha / r, or / sqrt(r) for rsLoRA) folded into B.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch

# PEFT module name (last component) -> (our module name, output slice). Packed names map to slice -1: the
# adapter covers the whole fused output (models whose checkpoints store qkv / gate_up fused, Phi-3).
MODULE_MAP: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
    "qkv_proj": ("qkv_proj", -1),
    "gate_up_proj": ("gate_up_proj", -1),
}
_PREFIX = "base_model.model."


@dataclass
class LoRAAdapter:
    """An adapter's weights on the host, keyed by our module names."""

    rank: int
    weights: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)
    """module -> slice (-1: the whole output) -> (A [r, in], scaling * B [out, r])."""

    def num_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for m in self.weights.values() for a, b in m.values())


def expected_shapes(hf_config: Any) -> dict[str, tuple[int, int]]:
    """(out, in) of each LoRA-targetable projection of a Llama-family model, from its config."""
    h = int(hf_config.hidden_size)
    nh = int(hf_config.num_attention_heads)
    nkv = int(getattr(hf_config, "num_key_value_heads", None) or nh)
    hd = int(getattr(hf_config, "head_dim", None) or h // nh)
    inter = int(hf_config.intermediate_size)
    return {
        "q_proj": (nh * hd, h),
        "k_proj": (nkv * hd, h),
        "v_proj": (nkv * hd, h),
        "o_proj": (h, nh * hd),
        "gate_proj": (inter, h),
        "up_proj": (inter, h),
        "down_proj": (h, inter),
        "qkv_proj": ((nh + 2 * nkv) * hd, h),
        "gate_up_proj": (2 * inter, h),
    }


def read_config(path: str) -> dict[str, Any]:
    """The adapter's config, with the features pagedllm does not serve refused (ValueError)."""
    if not path or not os.path.isdir(path):
        raise ValueError(f"lora_path: no adapter directory at {path!r}")
    cfg_file = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(cfg_file):
        raise ValueError(f"lora_path: {path!r} has no adapter_config.json (not a PEFT adapter)")
    try:
        with open(cfg_file) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"lora_path: cannot read {cfg_file}: {e}") from e
    if not isinstance(cfg, dict):
        raise ValueError(f"lora_path: {cfg_file} is not a JSON object")
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise ValueError(f"adapter: peft_type {cfg.get('peft_type')!r} is not supported (LORA only)")
    if cfg.get("modules_to_save"):
        raise ValueError(
            f"adapter: modules_to_save={cfg['modules_to_save']!r} is not supported (fully trained modules "
            "such as lm_head or embeddings cannot be swapped per request); save the adapter without them"
        )
    if cfg.get("use_dora"):
        raise ValueError("adapter: DoRA (use_dora=true) is not supported")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"adapter: bias={cfg['bias']!r} is not supported (only 'none')")
    if cfg.get("fan_in_fan_out"):
        raise ValueError("adapter: fan_in_fan_out=true (Conv1D bases) is not supported")
    return cfg


def _weight_file(path: str) -> str:
    for name in ("adapter_model.safetensors", "adapter_model.bin"):
        f = os.path.join(path, name)
        if os.path.isfile(f):
            return f
    raise ValueError(f"lora_path: {path!r} has no adapter_model.safetensors (or adapter_model.bin)")


def _pattern_value(patterns: dict[str, Any] | None, name: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern lookup: the first key matching the end of the module name."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default


def _parse_key(key: str) -> tuple[str, str, str] | None:
    """'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight' -> (module path without the
    last component, PEFT module name, 'A' or 'B'); None for keys that are not LoRA matrices."""
    m = re.fullmatch(r"(.*)\.lora_(A|B)(?:\.[^.]+)?\.weight", key)
    if m is None:
        return None
    full = m.group(1)
    full = full[len(_PREFIX) :] if full.startswith(_PREFIX) else full
    parent, _, leaf = full.rpartition(".")
    return parent, leaf, m.group(2)


def _check_tensors(
    shapes: dict[str, tuple[int, ...]], cfg: dict[str, Any], hf_config: Any, max_rank: int
) -> dict[str, tuple[str, int, str, str]]:
    """Validates names and shapes; returns tensor key -> (our module, slice, PEFT module name, A|B)."""
    expected = expected_shapes(hf_config)
    out: dict[str, tuple[str, int, str, str]] = {}
    for key, shape in shapes.items():
        if "lora_embedding" in key or "lora_magnitude" in key:
            raise ValueError(f"adapter: {key} (embedding LoRA / DoRA) is not supported")
        parsed = _parse_key(key)
        if parsed is None:
            raise ValueError(f"adapter: unexpected tensor {key!r} (only lora_A / lora_B weights are served)")
        parent, leaf, ab = parsed
        if leaf not in MODULE_MAP:
            raise ValueError(
                f"adapter: target module {leaf!r} is not supported (supported: {', '.join(sorted(MODULE_MAP))})"
            )
        e_out, e_in = expected[leaf]
        r = shape[0] if ab == "A" else shape[1]
        if r > max_rank:
            raise ValueError(f"adapter: rank {r} of {parent}.{leaf} exceeds max_lora_rank={max_rank}")
        want = (r, e_in) if ab == "A" else (e_out, r)
        if tuple(shape) != want:
            raise ValueError(
                f"adapter: {key} has shape {tuple(shape)}, the base model needs {want}: the adapter was "
                f"trained for another base model ({cfg.get('base_model_name_or_path')!r})"
            )
        mod, sl = MODULE_MAP[leaf]
        out[key] = (f"{parent}.{mod}", sl, f"{parent}.{leaf}", ab)
    if not out:
        raise ValueError("adapter: no lora_A / lora_B weights found")
    return out


def _header_shapes(weight_file: str) -> dict[str, tuple[int, ...]]:
    if weight_file.endswith(".safetensors"):
        from safetensors import safe_open

        with safe_open(weight_file, framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 - not a dict
    return {k: tuple(v.shape) for k, v in _read_tensors(weight_file).items()}


def _read_tensors(weight_file: str) -> dict[str, torch.Tensor]:
    if weight_file.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(weight_file)
    return torch.load(weight_file, map_location="cpu", weights_only=True)


def check_adapter(path: str, hf_config: Any, max_rank: int) -> int:
    """Validates the adapter at `path` against the base model without reading its weights; its rank."""
    cfg = read_config(path)
    shapes = _header_shapes(_weight_file(path))
    _check_tensors(shapes, cfg, hf_config, max_rank)
    return max(s[0] for k, s in shapes.items() if ".lora_A" in k)


def load_adapter(path: str, hf_config: Any, max_rank: int, dtype: torch.dtype) -> LoRAAdapter:
    """Reads and validates the adapter; A and scaled B in `dtype` (scaling applied in float32 first)."""
    cfg = read_config(path)
    tensors = _read_tensors(_weight_file(path))
    keys = _check_tensors({k: tuple(v.shape) for k, v in tensors.items()}, cfg, hf_config, max_rank)
    halves: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
    names: dict[tuple[str, int], str] = {}
    for key, (mod, sl, peft_name, half) in keys.items():
        halves.setdefault((mod, sl), {})[half] = tensors[key]
        names[(mod, sl)] = peft_name
    adapter = LoRAAdapter(rank=0)
    base_r = int(cfg.get("r", 8))
    base_alpha = float(cfg.get("lora_alpha", 8))
    for (mod, sl), pair in halves.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"adapter: {names[(mod, sl)]} has lora_{next(iter(pair))} without its pair")
        a, b = pair["A"].float(), pair["B"].float()
        if a.shape[0] != b.shape[1]:
            raise ValueError(f"adapter: {names[(mod, sl)]}: lora_A rank {a.shape[0]} != lora_B rank {b.shape[1]}")
        r = int(_pattern_value(cfg.get("rank_pattern"), names[(mod, sl)], base_r))
        alpha = float(_pattern_value(cfg.get("alpha_pattern"), names[(mod, sl)], base_alpha))
        scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        adapter.weights.setdefault(mod, {})[sl] = (a.to(dtype).contiguous(), (b * scaling).to(dtype).contiguous())
        adapter.rank = max(adapter.rank, a.shape[0])
    return adapter
