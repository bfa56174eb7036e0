"""The benchmark workloads build exactly the published request lists (token totals from their README)."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

# tests/benchmarks/ -> the repository root's benchmarks/workloads/
ROOT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks", "workloads"
)


def _load():
    spec = importlib.util.spec_from_file_location("pagedllm_bench_workloads", os.path.join(ROOT, "workloads.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


EXPECTED = {
    "W1": ("qwen3-0.6b", 256, 142_827, 133_966),
    "W2": ("llama-3.1-8b", 1000, 1_024_000, 128_000),
    "W3": ("llama-3.1-8b", 1, 128, 256),
    "W4": ("qwen3-0.6b", 64, 131_200, 2_048),
    "W6": ("qwen3-30b-a3b", 256, 142_827, 133_966),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_workload_token_totals(name: str) -> None:
    wl = _load()
    model, n, tok_in, tok_out = EXPECTED[name]
    w = wl.WORKLOADS[name]
    assert w["model"] == model
    reqs = w["make"]()
    assert wl.summary(reqs) == dict(num_requests=n, input_tokens=tok_in, output_tokens=tok_out)
    assert all(0 <= t <= 10000 for prompt, _ in reqs for t in prompt)


def test_w1_length_ranges_and_w4_shared_prefix() -> None:
    wl = _load()
    w1 = wl.w1()
    assert all(100 <= len(p) <= 1024 and 100 <= o <= 1024 for p, o in w1)
    w4 = wl.w4()
    prefix = w4[0][0][:2000]
    assert all(len(p) == 2050 and p[:2000] == prefix for p, _ in w4)
    assert len({tuple(p[2000:]) for p, _ in w4}) == 64


@pytest.mark.parametrize("model", ["qwen3-0.6b", "llama-3.1-8b", "qwen3-30b-a3b"])
def test_model_configs_present(model: str) -> None:
    with open(os.path.join(ROOT, model, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["num_attention_heads"] % cfg["num_key_value_heads"] == 0


def _tiny_bf16_llama(tied: bool):  # noqa: ANN202
    """A 2-layer bf16 Llama with a 128-token vocabulary and hidden size 32 (the floors' hand counts use these)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    return LlamaForCausalLM(cfg).to(torch.bfloat16)


@pytest.mark.parametrize("tied", [False, True])
def test_weight_read_bytes_counts_what_a_decode_step_reads(tied: bool) -> None:
    """The W3 floor's bytes: all weights but the embedding table, which a tied LM head reads whole."""
    from pagedllm.benchmarks.floors import weight_read_bytes

    model = _tiny_bf16_llama(tied)
    everything = sum(p.numel() for p in model.parameters()) * 2  # parameters() counts a tied tensor once
    embed = 128 * 32 * 2
    assert weight_read_bytes(model) == (everything if tied else everything - embed)


def test_throughput_floor_counts_by_hand() -> None:
    """One request of 4 prompt tokens (2 from the prefix cache) and 3 outputs on a tiny bf16 Llama."""
    from pagedllm.benchmarks.floors import throughput_floor, weight_read_bytes

    model = _tiny_bf16_llama(tied=False)
    w = weight_read_bytes(model)
    head, body = 128 * 32, w // 2 - 128 * 32
    f = throughput_floor(model, 2, 4, 2, 8, [(4, 3, 2)], 16384, copy_gbps=1.0, tflops=1e-3)
    # Tokens fed: 4 prompt + 2 outputs = 6, 4 of them computed; contexts 3..6 -> 18; 3 sampled.
    assert f.flops == 2 * body * 4 + 2 * head * 3 + 4 * 4 * 8 * 2 * 18
    # 3 steps (the longest output) of weights; K/V (2 x 2 heads x 8 x 2 B x 2 layers = 128 B a token)
    # written for 4 tokens, read: the 4-token prompt once, contexts 5 and 6 by the two decodes.
    assert f.bytes == 3 * w + 128 * (4 + 4 + 5 + 6)
    assert f.seconds == max(f.bytes / 1e9, f.flops / 1e9)
