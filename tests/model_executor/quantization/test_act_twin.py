"""FP8 twins of decode activations (quantization/act_twin.py): which producers get linked, and the hand-off's
rule that only the very tensor object a producer returned carries its twin. The kernels are tested on the
device (tests/gpu/test_act_twin_gpu.py)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig

from pagedllm.model_executor.layers.quantization import act_twin
from pagedllm.model_executor.layers.quantization.base import set_current_quant_config
from pagedllm.model_executor.layers.quantization.fp8 import Fp8Config
from pagedllm.model_executor.models.llama import LlamaForCausalLM

CFG = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128)  # fmt: skip


def test_link_producers_only_for_fp8_dynamic_linears() -> None:
    with set_current_quant_config(Fp8Config(serialized=False, static_activations=False, ignored=[])):
        fp8_model = LlamaForCausalLM(CFG)
    assert act_twin.link_producers(fp8_model) == 6  # 2 layers x (input norm, post-attention norm, SiLU-mul)
    assert all(layer.input_layernorm.fp8_twin for layer in fp8_model.model.layers)
    assert all(layer.mlp.act_fn.fp8_twin for layer in fp8_model.model.layers)
    with set_current_quant_config(Fp8Config(serialized=True, static_activations=True, ignored=[])):
        static_model = LlamaForCausalLM(CFG)
    assert act_twin.link_producers(static_model) == 0
    assert act_twin.link_producers(LlamaForCausalLM(CFG)) == 0


def test_only_the_returned_tensor_object_carries_the_twin() -> None:
    x = torch.randn(2, 8)
    q, s = torch.zeros(2, 8, dtype=torch.float8_e4m3fn), torch.ones(2, 1)
    out = act_twin.attach(x, q, s)
    assert out is x and act_twin.twin_of(x) == (q, s)
    assert act_twin.twin_of(x.view(2, 8)) is None
    assert act_twin.twin_of(x[:1]) is None
    assert act_twin.twin_of(x * 1) is None
    assert act_twin.twin_of(torch.randn(2, 8)) is None


def test_rows_slices_the_twin_along() -> None:
    x, q, s = torch.randn(6, 8), torch.randn(6, 8).to(torch.float8_e4m3fn), torch.rand(6, 1)
    part = act_twin.rows(act_twin.attach(x, q, s), 2, 5)
    assert torch.equal(part, x[2:5])
    twin = act_twin.twin_of(part)
    assert twin is not None and twin[0].data_ptr() == q[2].data_ptr() and torch.equal(twin[1], s[2:5])
    plain = act_twin.rows(torch.randn(6, 8), 0, 3)
    assert plain.shape == (3, 8) and act_twin.twin_of(plain) is None


def test_twins_only_for_16_bit_decode_rows_on_cuda() -> None:
    norm = torch.nn.Module()
    norm.fp8_twin = True
    cpu = torch.zeros(1, 8, dtype=torch.bfloat16)
    assert not act_twin.wants_twin(norm, cpu)  # (CUDA only)
    meta = torch.empty(1, 8, dtype=torch.bfloat16, device="meta")
    assert not act_twin.wants_twin(norm, meta)
