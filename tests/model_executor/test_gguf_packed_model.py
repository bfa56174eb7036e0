"""Acceptance 2: the real SmolLM2-135M-Instruct Q4_1 GGUF served packed (the default) against the same
file dequantized to float32 (`gguf_dequantize=True`): greedy outputs, the logit error, perplexity on a
fixed public-domain text; and the loader's surface (defaults, flags, split files, bad files)."""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams, TokensPrompt
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.model_executor.layers.linear import LinearBase
from pagedllm.model_executor.layers.quantization import gguf as gq
from pagedllm.model_executor.model_loader.loader import load_model

pytestmark = pytest.mark.skipif(not gq.kernels_available(), reason="no C compiler: GGUF kernels not built")

TEXT = Path(__file__).parent / "data" / "declaration_of_independence.txt"
GREEDY48 = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
GAP = 0.05  # the bound on the dequantized model's top-2 logprob gap where outputs may diverge


@pytest.fixture(scope="module")
def packed_llm(smollm2_path: str) -> LLM:
    """The packed float32 engine (float32 activations: only the packing and the Q8 activations differ
    from the dequantized reference)."""
    return LLM(smollm2_path, dtype="float32", max_model_len=2048, kv_cache_memory_bytes=256 << 20)


def model_config(**kw: object):  # noqa: ANN201
    return EngineArgs(device="cpu", dtype="float32", max_model_len=256, **kw).create_engine_config().model_config


def test_default_model_is_packed() -> None:
    mc = model_config()
    assert mc.quantization == "gguf"
    model = load_model(mc, "auto", "cpu")
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert linears and all(isinstance(m.quant_method, gq.GGUFLinearMethod) for m in linears)
    assert all("weight" not in dict(m.named_parameters()) for m in linears)
    assert {p.type_name for m in linears for p in m.quant_method.parts} == {"Q4_1"}
    assert [p.type_name for p in model.lm_head.gguf_weight] == ["Q8_0"]  # tied: token_embd's blocks
    dense = model_config(gguf_dequantize=True)
    assert dense.quantization is None
    model = load_model(dense, "auto", "cpu")
    assert not any(isinstance(m.quant_method, gq.GGUFLinearMethod) for m in model.modules() if isinstance(m, LinearBase))


def test_quantization_args_validated() -> None:
    with pytest.raises(ValueError, match="contradicts gguf_dequantize"):
        model_config(quantization="gguf", gguf_dequantize=True)
    with pytest.raises(ValueError, match="quantization: unsupported method 'awq'"):
        model_config(quantization="awq")
    assert model_config(quantization="gguf").quantization == "gguf"
    import argparse

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(["--gguf-dequantize"]))
    assert args.gguf_dequantize is True and args.quantization is None


def _teacher_forced(llm: LLM, ids: list[int], k: int = 2) -> dict[int, float]:
    """The model's top-k next-token logprobs after `ids`."""
    out = llm.generate(
        [TokensPrompt(prompt_token_ids=ids)], SamplingParams(temperature=0.0, max_tokens=1, logprobs=k), use_tqdm=False
    )[0]
    return {t: lp.logprob for t, lp in out.outputs[0].logprobs[0].items()}


def test_greedy_matches_dequantized(packed_llm: LLM, smollm2_llm: LLM, smollm2_prompt_ids: list[list[int]]) -> None:
    """>= 16/20 prompts x 48 tokens identical; the rest diverge only where the dequantized model's top-2
    gap is below 0.05. Prints the measured logit (logprob) error, teacher-forced on the reference."""
    prompts = [TokensPrompt(prompt_token_ids=p) for p in smollm2_prompt_ids]
    ours = [list(o.outputs[0].token_ids) for o in packed_llm.generate(prompts, GREEDY48, use_tqdm=False)]
    sp_ref = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=1)
    refs = smollm2_llm.generate(prompts, sp_ref, use_tqdm=False)
    identical, verdicts, errors = 0, [], []
    for p, o, r in zip(smollm2_prompt_ids, ours, refs):
        ref = list(r.outputs[0].token_ids)
        # Logprob error of the packed model, teacher-forced on the reference's tokens.
        forced = packed_llm.generate(
            [TokensPrompt(prompt_token_ids=p + ref[:-1])],
            SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0),
            use_tqdm=False,
        )[0].prompt_logprobs
        for j, tok in enumerate(ref[:-1]):
            errors.append(abs(forced[len(p) + j][tok].logprob - r.outputs[0].logprobs[j][tok].logprob))
        step = next((i for i, (a, b) in enumerate(zip(o, ref)) if a != b), None)
        if step is None:
            identical += 1
            continue
        top = sorted(_teacher_forced(smollm2_llm, p + ref[:step]).values(), reverse=True)
        verdicts.append((step, top[0] - top[1]))
    print(f"identical {identical}/20; divergences (step, reference top-2 gap): {verdicts}; "
          f"logprob error max {max(errors):.4f} mean {np.mean(errors):.5f} over {len(errors)} positions")  # fmt: skip
    assert identical >= 16
    assert all(gap < GAP for _, gap in verdicts), verdicts


def _perplexity(llm: LLM, ids: list[int]) -> float:
    out = llm.generate(
        [TokensPrompt(prompt_token_ids=ids)],
        SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0),
        use_tqdm=False,
    )[0]
    nll = [-out.prompt_logprobs[i][t].logprob for i, t in enumerate(ids) if i > 0]
    return math.exp(sum(nll) / len(nll))


def test_perplexity_within_one_percent(packed_llm: LLM, smollm2_llm: LLM, smollm2_tokenizer) -> None:  # noqa: ANN001
    ids = smollm2_tokenizer.encode(TEXT.read_text())
    assert 1800 <= len(ids) <= 2040
    packed, dense = _perplexity(packed_llm, ids), _perplexity(smollm2_llm, ids)
    print(f"perplexity over {len(ids)} tokens: packed {packed:.4f}, dequantized float32 {dense:.4f}")
    assert abs(packed / dense - 1) < 0.01


def test_split_gguf_loads(tmp_path: Path, smollm2_path: str) -> None:
    """A checkpoint split into `-0000i-of-0000N.gguf` files (metadata in the first, tensors spread) loads
    to the same weights as the single file."""
    import gguf

    reader = gguf.GGUFReader(smollm2_path)
    tensors = list(reader.tensors)
    names = [f"{tmp_path}/m-{i:05d}-of-00002.gguf" for i in (1, 2)]
    for i, (name, part) in enumerate(zip(names, (tensors[:100], tensors[100:]))):
        writer = gguf.GGUFWriter(name, arch="llama")
        if i == 0:
            for field in reader.fields.values():
                if field.name.startswith("GGUF.") or field.name == "general.architecture":
                    continue
                writer.add_key_value(field.name, field.contents(), field.types[0], field.types[-1])
        for t in part:
            writer.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    from pagedllm.model_executor.model_loader.gguf_loader import gguf_files

    assert gguf_files(names[0]) == names
    whole = load_model(model_config(), "auto", "cpu")
    split = load_model(model_config(model=names[0]), "auto", "cpu")
    x = torch.randn(3, 576)
    layer = "model.layers.29.mlp.down_proj"  # in the second file
    for name in ("model.layers.0.self_attn.qkv_proj", layer):
        src = whole.get_submodule(name).quant_method.parts
        dst = split.get_submodule(name).quant_method.parts
        assert all(torch.equal(p.data, q.data) for p, q in zip(src, dst))
    torch.testing.assert_close(whole.compute_logits(x), split.compute_logits(x))
    os.remove(names[1])
    with pytest.raises(ValueError, match="missing"):
        gguf_files(names[0])


def test_truncated_and_unsupported_files(tmp_path: Path, smollm2_path: str) -> None:
    from pagedllm.model_executor.model_loader.gguf_loader import gguf_weights_iterator, open_gguf

    cut = tmp_path / "cut.gguf"
    with open(smollm2_path, "rb") as src, open(cut, "wb") as dst:
        dst.write(src.read(os.path.getsize(smollm2_path) // 2))
    with pytest.raises(ValueError, match="truncated"):
        open_gguf(str(cut))
    import gguf

    odd = tmp_path / "odd.gguf"
    writer = gguf.GGUFWriter(str(odd), arch="llama")
    raw = np.zeros((4, 8 * 40), dtype=np.uint8)  # Q8_1 blocks: an activation type no checkpoint loader takes
    writer.add_tensor("blk.0.attn_q.weight", raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    cfg = SimpleNamespace(num_attention_heads=9, num_key_value_heads=3)
    with pytest.raises(ValueError, match=r"blk\.0\.attn_q\.weight has type Q8_1"):
        list(gguf_weights_iterator(str(odd), cfg))
