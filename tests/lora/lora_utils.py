"""Tiny random PEFT adapters for the LoRA tests, made with `peft` (or, where peft is absent, as on the GPU
machine, written in PEFT's file format with plain torch + safetensors)."""

from __future__ import annotations

import json
import os
from typing import Any

import torch

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_peft_adapter(hf_model: Any, out_dir: str, seed: int, r: int = 8, alpha: int = 16, **kw: Any) -> Any:
    """A PEFT LoRA adapter on every q/k/v/o/gate/up/down projection with random A AND B (PEFT's B starts at
    zero: scaled so the adapter visibly changes greedy outputs); saved to out_dir. The `PeftModel`."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=TARGETS, lora_dropout=0.0, **kw)
    pm = get_peft_model(hf_model, cfg)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn_like(p) * 0.3)
    pm.eval()
    pm.save_pretrained(out_dir)
    return pm


def write_raw_adapter(
    hf_config: Any, out_dir: str, seed: int, r: int = 8, alpha: int = 16, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """The same kind of adapter without peft: adapter_config.json + adapter_model.safetensors; the tensors."""
    from safetensors.torch import save_file

    from pagedllm.lora.peft import expected_shapes

    g = torch.Generator().manual_seed(seed)
    shapes = expected_shapes(hf_config)
    tensors = {}
    for layer in range(hf_config.num_hidden_layers):
        for mod in TARGETS:
            part = "self_attn" if mod in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{mod}"
            out, inp = shapes[mod]
            tensors[f"{key}.lora_A.weight"] = (torch.randn(r, inp, generator=g) / inp**0.5).to(dtype)
            tensors[f"{key}.lora_B.weight"] = (torch.randn(out, r, generator=g) * 0.3 / r**0.5).to(dtype)
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": TARGETS, "bias": "none"}
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)
    return tensors


def merged_reference(hf_model: Any, tensors: dict[str, torch.Tensor], scaling: float) -> Any:
    """A copy of the HF model with the adapter merged into its weights (W += scaling * B @ A): the
    reference where peft is not installed."""
    import copy

    m = copy.deepcopy(hf_model)
    params = dict(m.named_parameters())
    with torch.no_grad():
        for k, a in tensors.items():
            if ".lora_A." not in k:
                continue
            b = tensors[k.replace(".lora_A.", ".lora_B.")]
            w = params[k.replace("base_model.model.", "").replace(".lora_A.weight", ".weight")]
            w += (scaling * b.float() @ a.float()).to(w.dtype)
    return m
