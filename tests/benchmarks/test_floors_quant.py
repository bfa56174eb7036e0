"""The floors of a quantized model (benchmarks/quant_bench.sh's x-floor figures): FLOPs count the logical
parameters of the quantized linear layers, bytes count what they store, an FP8 KV cache counts 1 byte."""

from __future__ import annotations

import torch

from pagedllm.benchmarks.floors import quantized_linears, throughput_floor, weight_read_bytes
from pagedllm.model_executor.model_loader.loader import load_model
from tests.utils_model import make_model_config, make_tiny_hf_model


def test_fp8_model_floor_counts_logical_parameters(tmp_path) -> None:  # noqa: ANN001
    hf = make_tiny_hf_model("llama", tmp_path)
    dense_cfg = make_model_config(str(tmp_path), hf.config, torch.float32)
    dense = load_model(dense_cfg, "auto", "cpu")
    fp8_cfg = make_model_config(str(tmp_path), hf.config, torch.float32)
    fp8_cfg.quantization = "fp8"
    fp8 = load_model(fp8_cfg, "auto", "cpu")
    q_params, q_bytes, is_fp8 = quantized_linears(fp8)
    linear_params = sum(m.weight.numel() for n, m in dense.named_modules() if n.endswith(("_proj",)))
    assert is_fp8 and q_params == linear_params
    assert q_bytes == linear_params + sum(m.output_size for n, m in fp8.named_modules() if n.endswith("_proj")) * 4
    assert weight_read_bytes(fp8) == weight_read_bytes(dense) - 4 * linear_params + q_bytes
    req = [(4, 3, 0)]
    fd = throughput_floor(dense, 2, 4, 2, 16, req, 16384, copy_gbps=1.0, tflops=1e-3)
    fq = throughput_floor(fp8, 2, 4, 2, 16, req, 16384, copy_gbps=1.0, tflops=1e-3, fp8_tflops=2e-3)
    assert fq.flops == fd.flops  # same logical work
    lin_flops = 2 * linear_params * 6  # 6 computed tokens
    assert abs(fq.flops_s - (fd.flops_s - lin_flops / 1e9 + lin_flops / 2e9)) < 1e-9
