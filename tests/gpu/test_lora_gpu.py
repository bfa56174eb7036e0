"""Issue 21, acceptance 1 on the GPU: a tiny random float32 Llama with 3 random adapters in PEFT's format
(written with torch + safetensors: peft is not on the device), decode CUDA graphs (the default) and async
scheduling; 20 requests mixing the three adapters and the base model in one batch, of different lengths (the
graph's rows shift and pad), each greedy output equal to the per-adapter reference (the HF model with that
adapter merged into its weights) by the numerical-comparison policy."""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from pagedllm import LLM, LoRARequest, SamplingParams, TokensPrompt  # noqa: E402
from tests.hf_utils import compare_greedy, hf_greedy  # noqa: E402
from tests.lora.lora_utils import merged_reference, write_raw_adapter  # noqa: E402
from tests.utils_model import VOCAB, make_tiny_hf_model  # noqa: E402


def test_mixed_adapters_with_cuda_graphs_match_reference(tmp_path) -> None:  # noqa: ANN001
    hf = make_tiny_hf_model("llama", tmp_path / "base")
    adapters, refs_models = [], []
    for i, (r, alpha) in enumerate([(8, 16), (4, 8), (16, 16)]):
        path = str(tmp_path / f"adapter{i}")
        tensors = write_raw_adapter(hf.config, path, seed=20 + i, r=r, alpha=alpha)
        refs_models.append(merged_reference(hf, tensors, alpha / r).to("cuda"))
        adapters.append(LoRARequest(f"a{i}", i + 1, path))
    hf = hf.to("cuda")
    rng = random.Random(1)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randrange(3, 40))] for _ in range(20)]
    lengths = [8 + (i * 5) % 25 for i in range(20)]
    which = [None if i % 4 == 3 else i % 4 for i in range(20)]
    models = [hf if a is None else refs_models[a] for a in which]
    refs = [hf_greedy(m, p, n) for m, p, n in zip(models, prompts, lengths)]
    assert all(refs[i] != hf_greedy(hf, prompts[i], lengths[i]) for i in range(3))  # adapters matter
    llm = LLM(
        str(tmp_path / "base"),
        dtype="float32",
        skip_tokenizer_init=True,
        max_model_len=128,
        kv_cache_memory_bytes=64 << 20,
        enable_lora=True,
        max_loras=3,
        max_lora_rank=16,
    )
    runner = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner
    assert runner.cuda_graphs is not None and runner.lora.state.use_triton
    replays: list[int] = []
    real_run = runner.cuda_graphs.run
    runner.cuda_graphs.run = lambda *a, **k: replays.append(len(a[0])) or real_run(*a, **k)  # type: ignore[method-assign]
    sps = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False) for n in lengths]
    loras = [None if a is None else adapters[a] for a in which]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sps, use_tqdm=False, lora_request=loras)
    assert replays and max(replays) == 20 and min(replays) < 20
    for m, p, o, r in zip(models, prompts, outs, refs):
        compare_greedy(m, p, list(o.outputs[0].token_ids), r, torch.float32)
