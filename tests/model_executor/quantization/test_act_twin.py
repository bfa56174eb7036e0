"""Twins of decode activations (quantization/act_twin.py), FP8 and q8 (the GGUF int8 GEMV's): which producers
get linked, which batches get them, and the hand-off's rule that only the very tensor object a producer
returned carries its twin. The kernels are tested on the device (tests/gpu/test_act_twin_gpu.py)."""

from __future__ import annotations

import pytest
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
    assert all(layer.input_layernorm.twin_kind == "fp8" for layer in fp8_model.model.layers)
    assert all(layer.mlp.act_fn.twin_kind == "fp8" for layer in fp8_model.model.layers)
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


class _CudaLike:
    """What `wants_twin` reads of a tensor, for a CUDA tensor on a machine without one."""

    is_cuda = True

    def __init__(self, rows: int, dtype: torch.dtype = torch.bfloat16) -> None:
        self.dtype, self.shape = dtype, (rows, 8)

    def numel(self) -> int:
        return self.shape[0] * 8

    def dim(self) -> int:
        return 2


def test_which_batches_get_twins(monkeypatch) -> None:  # noqa: ANN001
    norm, plain = torch.nn.Module(), torch.nn.Module()
    norm.twin_kind = "fp8"
    x = _CudaLike
    assert act_twin.wants_twin(norm, x(1)) and act_twin.wants_twin(norm, x(4))
    assert act_twin.wants_twin(norm, x(300))  # batches above decode size too (the GEMM path reads them)
    assert not act_twin.wants_twin(plain, x(300))  # not a linked producer
    assert not act_twin.wants_twin(norm, x(4, torch.float32))
    # the SiLU-mul asks for more than MAX_ROWS rows (its one-program-a-row variant lost at decode sizes)
    assert not act_twin.wants_twin(norm, x(4), min_rows=act_twin.MAX_ROWS)
    assert act_twin.wants_twin(norm, x(5), min_rows=act_twin.MAX_ROWS)
    monkeypatch.setenv("PAGEDLLM_FP8_TWIN_PREFILL", "0")
    assert act_twin.wants_twin(norm, x(4)) and not act_twin.wants_twin(norm, x(5))


def test_the_gemm_path_reads_a_twin() -> None:
    """Batches above the GEMV's rows take an attached twin instead of quantizing (CPU: the emulated GEMM)."""
    from pagedllm.model_executor.layers.quantization import w8a8_ops

    g = torch.Generator().manual_seed(0)
    w, ws = w8a8_ops.quantize_weight_per_channel(torch.randn(24, 32, generator=g), w8a8_ops.FP8_DTYPE)
    x = torch.randn(7, 32, generator=g)
    plain = w8a8_ops.w8a8_linear(x, w, ws, None, None)
    same = act_twin.attach(x.clone(), *w8a8_ops._quantize_rows_torch(x, w8a8_ops.FP8_DTYPE, None))
    assert torch.equal(w8a8_ops.w8a8_linear(same, w, ws, None, None), plain)
    other = act_twin.attach(x.clone(), *w8a8_ops._quantize_rows_torch(x * 3, w8a8_ops.FP8_DTYPE, None))
    assert not torch.allclose(w8a8_ops.w8a8_linear(other, w, ws, None, None), plain, rtol=0.5)


def test_no_twins_off_cuda() -> None:
    norm = torch.nn.Module()
    norm.twin_kind = "fp8"
    cpu = torch.zeros(1, 8, dtype=torch.bfloat16)
    assert not act_twin.wants_twin(norm, cpu)  # (CUDA only)
    meta = torch.empty(1, 8, dtype=torch.bfloat16, device="meta")
    assert not act_twin.wants_twin(norm, meta)


def test_link_producers_for_gguf_int8_linears(monkeypatch: pytest.MonkeyPatch) -> None:
    """Layers whose linears hold GGUF parts prepared for the GPU's int8 GEMV link their producers as "q8";
    Q6_K-only parts (the float GEMV) and the CPU's parts link none. (The attention, o_proj's producer, is
    switched off here: the next test has it.)"""
    from pagedllm.model_executor.layers.linear import LinearBase
    from pagedllm.model_executor.layers.quantization import gguf as gq

    def gguf_model(qtype: int, triton: bool) -> LlamaForCausalLM:
        model = LlamaForCausalLM(CFG)
        for m in model.modules():
            if isinstance(m, LinearBase):
                n, k = m.weight.shape
                cls = gq.GGUFTritonWeight if triton else gq.GGUFWeight
                gq.install(m, [cls(qtype, torch.empty(0, dtype=torch.uint8), n, k)])
        return model

    monkeypatch.setenv("PAGEDLLM_ATTN_Q8_TWIN", "0")
    q4_1, q6_k = 3, 14
    model = gguf_model(q4_1, True)
    assert act_twin.link_producers(model) == 6
    assert all(layer.post_attention_layernorm.twin_kind == "q8" for layer in model.model.layers)
    assert all(layer.mlp.act_fn.twin_kind == "q8" for layer in model.model.layers)
    assert act_twin.link_producers(gguf_model(q6_k, True)) == 0
    assert act_twin.link_producers(gguf_model(q4_1, False)) == 0


def test_attention_links_o_proj_twin_unless_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """With PAGEDLLM_ATTN_Q8_TWIN (default on) the attention is o_proj's q8 producer too (its split-KV merge
    writes it); switched off, o_proj quantizes its input itself."""
    from pagedllm.model_executor.layers.linear import LinearBase
    from pagedllm.model_executor.layers.quantization import gguf as gq

    monkeypatch.setenv("PAGEDLLM_ATTN_Q8_TWIN", "1")
    model = LlamaForCausalLM(CFG)
    for m in model.modules():
        if isinstance(m, LinearBase):
            n, k = m.weight.shape
            gq.install(m, [gq.GGUFTritonWeight(3, torch.empty(0, dtype=torch.uint8), n, k)])
    assert act_twin.link_producers(model) == 8  # 2 layers x (the norms, the SiLU-mul, the attention)
    assert all(layer.self_attn.attn.twin_kind == "q8" for layer in model.model.layers)
    monkeypatch.setenv("PAGEDLLM_ATTN_Q8_TWIN", "0")
    for layer in model.model.layers:
        layer.self_attn.attn.twin_kind = None
    assert act_twin.link_producers(model) == 6
    assert all(layer.self_attn.attn.twin_kind is None for layer in model.model.layers)


class _CudaRows(_CudaLike):
    def __init__(self, rows: int, cols: int = 64, dtype: torch.dtype = torch.bfloat16) -> None:
        self.dtype, self.shape = dtype, (rows, cols)

    def numel(self) -> int:
        return self.shape[0] * self.shape[1]


def test_which_batches_get_q8_twins() -> None:
    norm = torch.nn.Module()
    norm.twin_kind = "q8"
    x = _CudaRows
    assert act_twin.wants_twin(norm, x(1)) == "q8" and act_twin.wants_twin(norm, x(act_twin.Q8_MAX_ROWS)) == "q8"
    assert act_twin.wants_twin(norm, x(act_twin.Q8_MAX_ROWS + 1)) is None  # the GEMM path reads no twin
    assert act_twin.wants_twin(norm, x(4), min_rows=act_twin.MAX_ROWS) == "q8"  # (the FP8 SiLU-mul's bound)
    assert act_twin.wants_twin(norm, x(1, dtype=torch.float32)) is None
    assert act_twin.wants_twin(norm, x(1, 40)) is None  # not whole groups of 32


def test_rows_slices_a_q8_twin() -> None:
    x = torch.randn(6, 64)
    q8 = act_twin.Q8Act(torch.zeros(6, 64, dtype=torch.int8), torch.rand(6, 2), torch.rand(6, 2))
    part = act_twin.rows(act_twin.attach(x, q8), 1, 4)
    twin = act_twin.twin_of(part)
    assert isinstance(twin, act_twin.Q8Act) and twin.q.shape == (3, 64) and torch.equal(twin.s, q8.s[1:4])
