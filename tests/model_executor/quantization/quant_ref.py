"""Reference quantizers and checkpoint writers for the quantization tests, written from the formats'
specifications (not from pagedllm's code): a tiny random HF Llama is quantized here, saved with each
format's tensor names, packing and `quantization_config`, and a float32 reference model is built from the
dequantized weights (with the activations fake-quantized where the format quantizes them)."""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

FP8 = torch.float8_e4m3fn
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
QUANT_OVERRIDES = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
}
AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def linear_modules(model: nn.Module) -> dict[str, nn.Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.split(".")[-1] in LINEARS}


def save_checkpoint(model: nn.Module, out_dir: str, tensors: dict[str, torch.Tensor], qcfg: dict[str, Any]) -> None:
    """Writes `tensors` (the quantized layers' tensors) plus every other weight of `model` as
    model.safetensors, and the model's config.json with `quantization_config`."""
    qlin = linear_modules(model)
    state = {}
    for name, t in model.state_dict().items():
        if name.rsplit(".", 1)[0] in qlin and name.endswith(".weight"):
            continue
        state[name] = t.contiguous()
    state.update({k: v.contiguous() for k, v in tensors.items()})
    os.makedirs(out_dir, exist_ok=True)
    save_file(state, os.path.join(out_dir, "model.safetensors"))
    cfg = model.config.to_dict()
    cfg["quantization_config"] = qcfg
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f)


# ---- 8-bit -------------------------------------------------------------------------------------------


def fake_quant_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x / scale).clamp(-448.0, 448.0).to(FP8).float() * scale


def fake_quant_int8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.round(x / scale).clamp(-128, 127) * scale


def quantize_w8(w: torch.Tensor, kind: str, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale): scale [N, 1] per channel or [] per tensor; kind 'fp8' or 'int8'."""
    qmax = 448.0 if kind == "fp8" else 127.0
    amax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax()
    scale = (amax / qmax).float()
    if kind == "fp8":
        return (w / scale).clamp(-448, 448).to(FP8), scale
    return torch.round(w / scale).clamp(-128, 127).to(torch.int8), scale


def calibrate_input_scales(model: nn.Module, prompts: list[list[int]], kind: str) -> dict[str, float]:
    """Static per-tensor input scales: amax of each quantized linear's input over the prompts / qmax."""
    qmax = 448.0 if kind == "fp8" else 127.0
    amax: dict[str, float] = {}
    hooks = []
    for name, mod in linear_modules(model).items():

        def hook(_m: nn.Module, args: tuple[torch.Tensor, ...], name: str = name) -> None:
            amax[name] = max(amax.get(name, 0.0), float(args[0].abs().max()))

        hooks.append(mod.register_forward_pre_hook(hook))
    with torch.no_grad():
        for p in prompts:
            model(torch.tensor([p]))
    for h in hooks:
        h.remove()
    return {n: a / qmax for n, a in amax.items()}


def make_w8a8_reference(
    model: nn.Module, kind: str, per_channel: bool, input_scales: dict[str, float] | None
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Replaces every quantized linear's weight by its dequantized value and fake-quantizes its input
    (per token when `input_scales` is None, else with the static scale); returns name -> (q, scale)."""
    fq = fake_quant_fp8 if kind == "fp8" else fake_quant_int8
    qmax = 448.0 if kind == "fp8" else 127.0
    out = {}
    for name, mod in linear_modules(model).items():
        q, s = quantize_w8(mod.weight.data, kind, per_channel)
        out[name] = (q, s)
        mod.weight.data = q.float() * s
        if input_scales is None:

            def pre(_m: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
                x = args[0]
                scale = (x.abs().amax(dim=-1, keepdim=True) / qmax).clamp(min=1e-10)
                return (fq(x, scale),)

        else:
            static = torch.tensor(input_scales[name])

            def pre(
                _m: nn.Module, args: tuple[torch.Tensor, ...], static: torch.Tensor = static
            ) -> tuple[torch.Tensor]:
                return (fq(args[0], static),)

        mod.register_forward_pre_hook(pre)
    return out


# ---- int4 ---------------------------------------------------------------------------------------------


def quantize_int4(w: torch.Tensor, group: int, sym: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """4-bit min/max quantization of w [N, K] by groups of `group` input columns, asymmetric (AWQ) or
    symmetric with zero 8 (GPTQ sym=True): (q [K, N] in 0..15, zeros [K/G, N], scales [K/G, N]);
    w.T ~= (q - z) * s."""
    n, k = w.shape
    wg = w.t().reshape(k // group, group, n)
    lo = wg.amin(dim=1).clamp(max=0)
    hi = wg.amax(dim=1).clamp(min=0)
    if sym:
        scales = (torch.maximum(-lo, hi) * 2 / 15).clamp(min=1e-6)
        zeros = torch.full_like(scales, 8.0)
    else:
        scales = ((hi - lo) / 15).clamp(min=1e-6)
        zeros = torch.round(-lo / scales).clamp(0, 15)
    q = torch.round(wg / scales[:, None] + zeros[:, None]).clamp(0, 15)
    return q.reshape(k, n).to(torch.int32), zeros.to(torch.int32), scales


def int4_dequant(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """[K, N] float32 weight (transpose of nn.Linear's)."""
    return (q.float() - zeros.float().repeat_interleave(group, 0)) * scales.float().repeat_interleave(group, 0)


def _to_int32(v: torch.Tensor) -> torch.Tensor:
    v = v.to(torch.int64)
    return torch.where(v >= 2**31, v - 2**32, v).to(torch.int32)


def pack_awq(q: torch.Tensor) -> torch.Tensor:
    """[R, N] 4-bit values -> [R, N/8] int32, AutoAWQ's order (word nibble i = column AWQ_PACK_ORDER[i])."""
    r, n = q.shape
    qv = q.to(torch.int64).reshape(r, n // 8, 8)
    out = torch.zeros(r, n // 8, dtype=torch.int64)
    for i, col in enumerate(AWQ_PACK_ORDER):
        out |= qv[:, :, col] << (4 * i)
    return _to_int32(out)


def pack_gptq_qweight(q: torch.Tensor) -> torch.Tensor:
    """[K, N] -> [K/8, N] int32: word row r holds input rows 8r..8r+7, row 8r+j at bits 4j."""
    k, n = q.shape
    qv = q.to(torch.int64).reshape(k // 8, 8, n)
    out = torch.zeros(k // 8, n, dtype=torch.int64)
    for j in range(8):
        out |= qv[:, j, :] << (4 * j)
    return _to_int32(out)


def pack_gptq_cols(z: torch.Tensor) -> torch.Tensor:
    """[R, N] -> [R, N/8] int32 in natural order (GPTQ's qzeros)."""
    r, n = z.shape
    zv = (z.to(torch.int64) & 0xF).reshape(r, n // 8, 8)
    out = torch.zeros(r, n // 8, dtype=torch.int64)
    for j in range(8):
        out |= zv[:, :, j] << (4 * j)
    return _to_int32(out)


def write_int4_checkpoint(model: nn.Module, out_dir: str, fmt: str, group: int) -> None:
    """Quantizes the linears of `model` (in place: their weights become the dequantized values) and saves
    the checkpoint in AutoAWQ ('awq') or AutoGPTQ ('gptq') layout."""
    tensors = {}
    for name, mod in linear_modules(model).items():
        q, z, s = quantize_int4(mod.weight.data, group, sym=fmt == "gptq")
        s16 = s.half()
        mod.weight.data = int4_dequant(q, z, s16, group).t().contiguous()
        if fmt == "awq":
            tensors[f"{name}.qweight"] = pack_awq(q)
            tensors[f"{name}.qzeros"] = pack_awq(z)
        else:
            tensors[f"{name}.qweight"] = pack_gptq_qweight(q)
            tensors[f"{name}.qzeros"] = pack_gptq_cols(z - 1)  # AutoGPTQ stores zero - 1
            tensors[f"{name}.g_idx"] = torch.arange(q.shape[0], dtype=torch.int32) // group
        tensors[f"{name}.scales"] = s16
    if fmt == "awq":
        qcfg = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    else:
        qcfg = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False, "sym": True}
    save_checkpoint(model, out_dir, tensors, qcfg)
