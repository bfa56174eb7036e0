"""`layers.l2_prefetch`: which weights each layer's attention is given to ask L2 for (the prefetch itself is
a GPU hint: compiled for sm_90 in tests/test_pdl.py, run on the device in tests/gpu/test_triton_attention.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from pagedllm.model_executor.layers.l2_prefetch import (
    link_attention_prefetch,
    link_prefetch,
    parse_targets,
    prefetch_table,
    table_for,
    weight_tensors,
)
from pagedllm.model_executor.models.llama import LlamaForCausalLM

CFG = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128)  # fmt: skip


def _rows(t: torch.Tensor) -> list[int]:
    return [t.data_ptr(), t.numel() * t.element_size()]


def _model() -> LlamaForCausalLM:
    model = LlamaForCausalLM(CFG)
    for layer in model.model.layers:
        layer.self_attn.attn.impl.l2_prefetch = None  # (as the Triton backend has it; the CPU one has none)
    return model


def test_tables_name_o_proj_and_the_next_qkv() -> None:
    model = _model()
    layers = [layer.self_attn for layer in model.model.layers]
    assert link_attention_prefetch(model, ("o", "qkv")) == 3
    for i, sa in enumerate(layers):
        want = [_rows(sa.o_proj.weight)] + ([_rows(layers[i + 1].qkv_proj.weight)] if i + 1 < len(layers) else [])
        assert sa.attn.impl.l2_prefetch.tolist() == want
    assert link_attention_prefetch(model, ("qkv",)) == 2  # the last layer has no next qkv
    assert layers[-1].attn.impl.l2_prefetch is None
    assert link_attention_prefetch(model, ()) == 0
    assert all(sa.attn.impl.l2_prefetch is None for sa in layers)


def test_backends_without_the_attribute_are_skipped() -> None:
    model = LlamaForCausalLM(CFG)
    assert not hasattr(model.model.layers[0].self_attn.attn.impl, "l2_prefetch")
    assert link_attention_prefetch(model, ("o",)) == 0


def test_gguf_parts_give_their_quants_and_scales() -> None:
    from pagedllm.model_executor.layers.quantization import gguf as gq

    model = _model()
    o = model.model.layers[0].self_attn.o_proj
    n, k = o.weight.shape
    part = gq.GGUFTritonWeight(3, torch.zeros(n * k // 8, dtype=torch.int32), n, k)
    part.d = torch.zeros(n, k // 32, dtype=torch.float16)
    part.dm = torch.zeros(n, k // 32, dtype=torch.float16)
    gq.install(o, [part])
    assert [t.data_ptr() for t in weight_tensors(o)] == [part.data.data_ptr(), part.d.data_ptr(), part.dm.data_ptr()]
    link_attention_prefetch(model, ("o",))
    assert model.model.layers[0].self_attn.attn.impl.l2_prefetch.tolist() == [
        _rows(part.data),
        _rows(part.d),
        _rows(part.dm),
    ]


def test_unknown_targets_are_refused() -> None:
    assert parse_targets(" o, qkv ") == ("o", "qkv")
    assert parse_targets("") == ()
    assert parse_targets("norm,silu") == ("norm", "silu")
    with pytest.raises(ValueError, match="PAGEDLLM_ATTN_L2_PREFETCH"):
        parse_targets("o,down")


def test_norms_and_silu_ask_for_a_prefix_of_the_linear_they_feed() -> None:
    model = _model()
    assert link_prefetch(model, ("norm", "silu"), prefix_bytes=1 << 12) == 3 * 3
    for layer in model.model.layers:
        for producer, linear in [
            (layer.input_layernorm, layer.self_attn.qkv_proj),
            (layer.post_attention_layernorm, layer.mlp.gate_up_proj),
            (layer.mlp.act_fn, layer.mlp.down_proj),
        ]:
            w = linear.weight
            assert w.numel() * w.element_size() > 1 << 12  # (a prefix, not the whole)
            assert producer.l2_prefetch.tolist() == [[w.data_ptr(), 1 << 12]]
        assert layer.self_attn.attn.impl.l2_prefetch is None  # ("o" / "qkv" not named)
    assert link_prefetch(model, ("silu",), prefix_bytes=1 << 12) == 3
    assert all(layer.input_layernorm.l2_prefetch is None for layer in model.model.layers)
    assert link_prefetch(model, ()) == 0
    assert all(layer.mlp.act_fn.l2_prefetch is None for layer in model.model.layers)


def test_a_prefix_takes_the_same_share_of_each_tensor() -> None:
    a, b = torch.zeros(1000, dtype=torch.int32), torch.zeros(1000, dtype=torch.float16)  # 4000 + 2000 bytes
    assert prefetch_table([a, b], prefix_bytes=3000).tolist() == [[a.data_ptr(), 2000], [b.data_ptr(), 992]]
    assert prefetch_table([a, b], prefix_bytes=10**6).tolist() == [[a.data_ptr(), 4000], [b.data_ptr(), 2000]]


def test_only_decode_batches_prefetch() -> None:
    norm = _model().model.layers[0].input_layernorm
    assert table_for(norm, torch.zeros(1, 64)) is None  # no table
    norm.l2_prefetch = torch.zeros(1, 2, dtype=torch.int64)
    assert table_for(norm, torch.zeros(8, 64)) is norm.l2_prefetch
    assert table_for(norm, torch.zeros(9, 64)) is None  # a prefill: its GEMM reads the weights its own way
