"""The GGUF decode stack (`quantization/gguf_decode_stack.py`, `csrc/decode_stack.c`): a packed SmolLM2's
decode steps run every layer in one C call, and the result is bit-identical to the Python layers (the same
kernels in the same order); steps and models it does not take fall back to the Python layers."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.model_executor.layers.quantization import gguf as gq
from pagedllm.model_executor.layers.quantization.gguf_blocks import GGUFWeight
from pagedllm.model_executor.layers.quantization.gguf_decode_stack import DecodeStack

pytestmark = pytest.mark.skipif(not gq.kernels_available(), reason="no C compiler: GGUF kernels not built")

PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "What is 2+2?",
    "List three colors of the rainbow, then explain why the sky is blue in one long sentence.",
    "Hi",
]


@pytest.fixture(scope="module")
def llm(smollm2_path: str) -> LLM:
    # Small steps: the long prompt is prefilled in chunks while the others already decode (mixed steps).
    return LLM(
        smollm2_path, dtype="float32", max_model_len=512, kv_cache_memory_bytes=64 << 20, max_num_batched_tokens=16
    )


def inner_model(llm: LLM) -> torch.nn.Module:
    return llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.model.model


@pytest.fixture
def counted(llm: LLM) -> Iterator[dict[str, int]]:
    """Counts the stack's decode steps (run returned outputs) and its refusals (returned None)."""
    stack = inner_model(llm).decode_stack
    assert isinstance(stack, DecodeStack)
    counts = {"ran": 0, "declined": 0}
    real = stack.run

    def run(*args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        out = real(*args)
        counts["ran" if out is not None else "declined"] += 1
        return out

    stack.run = run  # type: ignore[method-assign]
    try:
        yield counts
    finally:
        del stack.run


def stack_runs(llm: LLM) -> tuple[DecodeStack, list[int]]:
    """The model's decode stack, its `run` wrapped to count the steps it ran (list[0]) rather than declined."""
    stack = inner_model(llm).decode_stack
    assert isinstance(stack, DecodeStack)
    ran = [0]
    real = stack.run

    def run(*args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        out = real(*args)
        ran[0] += out is not None
        return out

    stack.run = run  # type: ignore[method-assign]
    return stack, ran


def generate(llm: LLM, n: int = 24) -> list[tuple[list[int], list[list[tuple[int, float]]]]]:
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=3)
    llm.reset_prefix_cache()  # every run prefills the same way (a cached prefix takes another attention path)
    outs = llm.generate(PROMPTS, sp, use_tqdm=False)
    return [
        (list(o.outputs[0].token_ids), [sorted((t, lp.logprob) for t, lp in d.items()) for d in o.outputs[0].logprobs])
        for o in outs
    ]


def python_layers(llm: LLM) -> list[tuple[list[int], list[list[tuple[int, float]]]]]:
    model = inner_model(llm)
    stack, model.decode_stack = model.decode_stack, None
    try:
        return generate(llm)
    finally:
        model.decode_stack = stack


def test_bit_identical_to_the_python_layers(llm: LLM, counted: dict[str, int]) -> None:
    ours = generate(llm)
    assert counted["ran"] >= 20, counted  # the pure-decode steps
    assert counted["declined"] >= 3, counted  # steps still prefilling the long prompt in chunks
    assert ours == python_layers(llm)  # tokens and top-3 logprobs, exactly


def test_bf16_kv_cache_bit_identical_to_the_python_layers(smollm2_path: str) -> None:
    """`kv_cache_dtype="bfloat16"` under the float32 model: the stack writes and reads the bfloat16 cache with
    the same kernels as the Python layers (rounding once on the write, float32 math after)."""
    llm = LLM(
        smollm2_path,
        dtype="float32",
        kv_cache_dtype="bfloat16",
        max_model_len=512,
        kv_cache_memory_bytes=32 << 20,
        max_num_batched_tokens=16,
    )
    stack, ran = stack_runs(llm)
    ours = generate(llm)
    assert ran[0] >= 20 and stack.dims.cache_bf16 == 1
    assert ours == python_layers(llm)


@pytest.mark.parametrize(("kv_dtype", "calculate"), [("fp8", True), ("fp8_e5m2", False)])
def test_fp8_kv_cache_bit_identical_to_the_python_layers(
    smollm2_path: str, kv_dtype: str, calculate: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An FP8 KV cache (scales from the first batch, or 1.0): the stack quantizes into it and decodes from it with
    the same C kernels as the Python layers' attention backend (which must take them, not its PyTorch decode)."""
    from pagedllm.attention.ops import cpu_paged_attn

    llm = LLM(
        smollm2_path,
        dtype="float32",
        kv_cache_dtype=kv_dtype,
        calculate_kv_scales=calculate,
        max_model_len=512,
        kv_cache_memory_bytes=32 << 20,
        max_num_batched_tokens=16,
    )
    stack, ran = stack_runs(llm)
    ours = generate(llm)
    assert ran[0] >= 20 and stack.dims.cache_fp8 == {"fp8": 1, "fp8_e5m2": 2}[kv_dtype]
    scales = {float(layer.self_attn.attn.k_scale) for layer in inner_model(llm).layers}
    assert (scales == {1.0}) != calculate
    c_decodes = 0
    decode = cpu_paged_attn.paged_decode

    def counted_decode(*args: object, **kw: object) -> None:
        nonlocal c_decodes
        c_decodes += 1
        decode(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(cpu_paged_attn, "paged_decode", counted_decode)
    assert ours == python_layers(llm)
    assert c_decodes > 0


def test_rebuilds_after_a_cache_or_weight_change_and_declines_hooks(llm: LLM, counted: dict[str, int]) -> None:
    ref = python_layers(llm)
    stack = inner_model(llm).decode_stack
    assert isinstance(stack, DecodeStack)
    stack._held = []  # as if a cache had been replaced: the pointer table is read again
    assert generate(llm) == ref and counted["ran"] > 0
    # A weight replaced by a copy (as a weight update would): the table must point at the new bytes.
    method = inner_model(llm).layers[5].mlp.down_proj.quant_method
    old = method.parts[0]
    method.parts[0] = GGUFWeight(old.qtype, old.data.clone(), old.rows, old.cols)
    try:
        assert generate(llm) == ref
        assert any(t is method.parts[0].data for t in stack._held)
    finally:
        method.parts[0] = old
    # A forward hook (how LoRA adds its deltas) on any linear: the stack steps aside.
    linear = inner_model(llm).layers[3].mlp.down_proj
    handle = linear.register_forward_hook(lambda m, a, out: out)
    try:
        counted["ran"] = counted["declined"] = 0
        assert generate(llm) == ref
        assert counted["ran"] == 0 and counted["declined"] > 0
    finally:
        handle.remove()


def test_one_parallel_region_is_bit_identical(llm: LLM, counted: dict[str, int]) -> None:
    """With 2+ threads and every linear tiled for AVX-512 VNNI, a step runs in one OpenMP region with spinning
    barriers (`csrc/decode_stack.c`); its outputs equal one region per kernel's and the Python layers'."""
    if torch.get_num_threads() < 2 or gq.isa_name() != "AVX-512 VNNI":
        pytest.skip("one region needs 2+ threads and the tiled AVX-512 VNNI weights")
    lib = inner_model(llm).decode_stack.lib
    previous = lib.gguf_decode_stack_set_one_region(1)
    try:
        ours = generate(llm)
        lib.gguf_decode_stack_set_one_region(0)
        assert ours == generate(llm)
    finally:
        lib.gguf_decode_stack_set_one_region(previous)
    assert counted["ran"] >= 40, counted
    assert ours == python_layers(llm)


def test_not_attached_where_it_does_not_apply(llm: LLM, smollm2_llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    assert inner_model(smollm2_llm).decode_stack is None  # dense (dequantized) weights: the Python layers
    model = inner_model(llm)
    assert isinstance(DecodeStack.build(model), DecodeStack)
    monkeypatch.setenv("PAGEDLLM_CPU_DECODE_STACK", "0")
    assert DecodeStack.build(model) is None
    monkeypatch.delenv("PAGEDLLM_CPU_DECODE_STACK")
    qkv = model.layers[0].self_attn.qkv_proj
    monkeypatch.setattr(qkv, "bias", torch.nn.Parameter(torch.zeros(qkv.output_size_per_partition)))
    assert DecodeStack.build(model) is None  # a projection bias (Qwen2's): not a layer the stack runs
