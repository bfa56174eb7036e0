"""Tensor and pipeline parallelism on several GPUs (issue 25, run 1): greedy outputs at tp=2 / tp=4 / pp=2
equal tp=1's, with NCCL, decode CUDA graphs and the GPU's defaults.

- Tiny random float32 checkpoints (Llama, Qwen3): the float32 policy, logprobs by token id within 1e-4
  (`tests/executor/parallel_utils.py`), with the all-reduce fused into the residual add + RMSNorm (the
  default), with NCCL alone and with the one-shot symmetric-memory all-reduce.
- The real SmolLM2 GGUF in bf16: 9 query heads / 3 KV heads, so tp=2 is refused (a clear ValueError, tested on
  the CPU) and tp=3 is the tensor-parallel run; pp=2 splits its 30 layers 15 / 15. The bf16 rule: against
  tp=1, no more failing prompts than HF bf16 against itself with only its attention kernel changed.

Each test skips where the machine has too few GPUs."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from pagedllm import LLM, SamplingParams, TokensPrompt  # noqa: E402
from tests.executor.parallel_utils import assert_same_outputs, tiny_prompts  # noqa: E402
from tests.hf_utils import hf_bf16_kernel_refs, judge_all  # noqa: E402
from tests.utils_model import make_tiny_hf_model  # noqa: E402

NGPU = torch.cuda.device_count()
VARIANTS = ("llama", "qwen3")


def _needs(n: int) -> pytest.MarkDecorator:
    return pytest.mark.skipif(NGPU < n, reason=f"needs {n} GPUs, this machine has {NGPU}")


def _fast_all_reduce(_worker: Any) -> bool:
    from pagedllm.distributed import parallel_state

    return parallel_state._FAST_ALL_REDUCE is not None


def _fused_norms(worker: Any) -> bool:
    """Whether the model's norms all-reduce (distributed/fused_allreduce_norm.py)."""
    model = worker.model_runner.model.model
    return all(layer.post_attention_layernorm.tp_reduce is not None for layer in model.stage_layers)


def _run(model: str, prompts: list[list[int]], sp: SamplingParams, **kw: Any) -> tuple[list[Any], dict[str, Any]]:
    """One engine's outputs, and per worker whether decode CUDA graphs were captured and the one-shot
    all-reduce is on."""
    llm = LLM(model, **kw)
    try:
        info: dict[str, Any] = {}
        if kw.get("tensor_parallel_size", 1) * kw.get("pipeline_parallel_size", 1) > 1:
            info["graphs"] = llm.collective_rpc(lambda w: w.model_runner.cuda_graphs is not None)
            info["fast_all_reduce"] = llm.collective_rpc(_fast_all_reduce)
            info["fused_norms"] = llm.collective_rpc(_fused_norms)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
        return [o.outputs[0] for o in outs], info
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()


TINY = {"dtype": "float32", "skip_tokenizer_init": True, "max_model_len": 128, "kv_cache_memory_bytes": 16 << 20}
TINY_SP = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, detokenize=False, logprobs=2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, list[Any]]]:
    """Per variant: the checkpoint and its tp=1 outputs (in-process executor)."""
    out = {}
    for variant in VARIANTS:
        path = str(tmp_path_factory.mktemp(variant))
        make_tiny_hf_model(variant, path)
        out[variant] = (path, _run(path, tiny_prompts(), TINY_SP, **TINY)[0])
    return out


LAYOUTS = {  # GPUs, engine arguments, environment (PAGEDLLM_TP_ALLREDUCE unset: the default, "fused")
    "tp2": (2, {"tensor_parallel_size": 2}, {}),
    "tp2_nccl": (2, {"tensor_parallel_size": 2}, {"PAGEDLLM_TP_ALLREDUCE": "nccl"}),
    "tp2_symm": (2, {"tensor_parallel_size": 2}, {"PAGEDLLM_TP_ALLREDUCE": "symm"}),
    # Eager prefill steps past the fused kernel's 6 rows (NCCL, then the norm) with the MLPs in chunks of 8
    # tokens (every chunk's down_proj output a partial sum, reduced with the whole batch); decode (6 requests)
    # fused, in the decode graphs.
    "tp2_mlp_chunks": (
        2,
        {"tensor_parallel_size": 2},
        {"PAGEDLLM_TP_FUSED_MAX_ROWS": "6", "PAGEDLLM_MLP_CHUNK_TOKENS": "8", "PAGEDLLM_PIECEWISE_MAX_TOKENS": "0"},
    ),
    "pp2": (2, {"pipeline_parallel_size": 2}, {}),
    "tp4": (4, {"tensor_parallel_size": 4}, {}),
    "tp2_pp2": (4, {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}, {}),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("variant", VARIANTS)
def test_tiny_f32_matches_tp1(
    variant: str, layout: str, tiny: dict[str, tuple[str, list[Any]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    n, kw, env = LAYOUTS[layout]
    if NGPU < n:
        pytest.skip(f"needs {n} GPUs, this machine has {NGPU}")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    all_reduce = env.get("PAGEDLLM_TP_ALLREDUCE")
    path, ref = tiny[variant]
    got, info = _run(path, tiny_prompts(), TINY_SP, **TINY, **kw)
    print(f"{variant} {layout}: {info}")
    # Decode CUDA graphs (with the all-reduces captured) on every rank; pipeline stages run eagerly.
    pp = kw.get("pipeline_parallel_size", 1)
    assert info["graphs"] == [pp == 1] * n
    assert all(info["fast_all_reduce"]) == (all_reduce == "symm")
    fused = all_reduce in (None, "fused") and kw.get("tensor_parallel_size", 1) == 2 and pp == 1
    assert info["fused_norms"] == [fused] * n
    assert_same_outputs(ref, got)


SMOL = {"dtype": "bfloat16", "max_model_len": 2048, "kv_cache_memory_bytes": 1 << 30}
SMOL_SP = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)


@pytest.fixture(scope="module")
def smol_refs(smollm2_path: str, smollm2_prompt_ids: list[list[int]]) -> dict[str, Any]:
    """tp=1 outputs, HF bf16 (the judge), and the bar: HF bf16's failing prompts with another attention kernel."""
    prompts = smollm2_prompt_ids
    hf, refs, refs_flash, refs_eager = hf_bf16_kernel_refs(smollm2_path, prompts, 48)
    bar = max(
        sum(r.startswith("FAIL") for r in judge_all(hf, prompts, other, refs, torch.bfloat16))
        for other in (refs_flash, refs_eager)
    )
    tp1 = [list(o.token_ids) for o in _run(smollm2_path, prompts, SMOL_SP, **SMOL)[0]]
    return {"hf": hf, "tp1": tp1, "bar": bar}


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param({"pipeline_parallel_size": 2}, id="pp2", marks=_needs(2)),
        pytest.param({"tensor_parallel_size": 3}, id="tp3", marks=_needs(3)),
    ],
)
def test_smollm2_bf16_matches_tp1(
    layout: dict[str, int], smollm2_path: str, smollm2_prompt_ids: list[list[int]], smol_refs: dict[str, Any]
) -> None:
    prompts = smollm2_prompt_ids
    outs, info = _run(smollm2_path, prompts, SMOL_SP, **SMOL, **layout)
    ours = [list(o.token_ids) for o in outs]
    res = judge_all(smol_refs["hf"], prompts, ours, smol_refs["tp1"], torch.bfloat16)
    fails = [r for r in res if r.startswith("FAIL")]
    identical = sum(r.startswith("identical") for r in res)
    print(f"SmolLM2 bf16 {layout} vs tp=1: {identical} / {len(res)} identical, {len(fails)} failing "
          f"(HF attention-kernel bar {smol_refs['bar']}); {info}; {fails}")  # fmt: skip
    assert len(fails) <= smol_refs["bar"]
