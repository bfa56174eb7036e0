"""The multi-process executor on the CPU (gloo): tensor-parallel outputs equal tp=1's (acceptance 1), the
RPC path, and the in-process executor staying the default for one device."""

from __future__ import annotations

import pytest

from pagedllm import LLM
from tests.executor.parallel_utils import assert_same_outputs, run_engine, tiny_prompts
from tests.utils_model import make_tiny_hf_model

VARIANTS = ("llama", "qwen3")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    out = {}
    for variant in VARIANTS:
        path = tmp_path_factory.mktemp(variant)
        make_tiny_hf_model(variant, path)
        out[variant] = str(path)
    return out


@pytest.fixture(scope="module")
def references(checkpoints: dict[str, str]) -> dict[str, list]:
    """tp=1 through the default (in-process) executor."""
    return {v: run_engine(path, tiny_prompts()) for v, path in checkpoints.items()}


@pytest.mark.parametrize("variant", VARIANTS)
def test_tp2_matches_tp1(variant: str, checkpoints: dict[str, str], references: dict[str, list]) -> None:
    got = run_engine(checkpoints[variant], tiny_prompts(), tensor_parallel_size=2)
    assert_same_outputs(references[variant], got)


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_tp4_matches_tp1(variant: str, checkpoints: dict[str, str], references: dict[str, list]) -> None:
    """4 query heads / 2 KV heads over 4 ranks: every KV head replicated on two ranks."""
    got = run_engine(checkpoints[variant], tiny_prompts(), tensor_parallel_size=4)
    assert_same_outputs(references[variant], got)


def test_tp1_mp_backend_matches_inprocess(checkpoints: dict[str, str], references: dict[str, list]) -> None:
    """tp=1 with the worker in its own process (the device benchmark's A/B) gives the same outputs."""
    got = run_engine(checkpoints["llama"], tiny_prompts(), distributed_executor_backend="mp")
    assert_same_outputs(references["llama"], got)


def test_tp1_mp_backend_async_scheduling_matches_inprocess(
    checkpoints: dict[str, str], references: dict[str, list]
) -> None:
    """The GPU's default path (async scheduling: step N+1 launched before N is read) through the worker
    process, with the compact steady-decode messages (`executor/wire.py`) in both directions."""
    got = run_engine(checkpoints["llama"], tiny_prompts(), distributed_executor_backend="mp", async_scheduling=True)
    assert_same_outputs(references["llama"], got)


def test_default_executor_is_in_process(checkpoints: dict[str, str]) -> None:
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.executor import get_executor_class
    from pagedllm.executor.multiproc_executor import MultiprocExecutor
    from pagedllm.executor.uniproc_executor import UniProcExecutor

    def cls(**kw: object) -> type:
        args = EngineArgs(model=checkpoints["llama"], skip_tokenizer_init=True, device="cpu", **kw)  # type: ignore[arg-type]
        return get_executor_class(args.create_engine_config())

    assert cls() is UniProcExecutor
    assert cls(tensor_parallel_size=2) is MultiprocExecutor
    assert cls(distributed_executor_backend="mp") is MultiprocExecutor
    with pytest.raises(ValueError, match="distributed_executor_backend"):
        cls(tensor_parallel_size=2, distributed_executor_backend="uni")
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        cls(tensor_parallel_size=0)


def test_collective_rpc_reaches_every_worker(checkpoints: dict[str, str]) -> None:
    llm = LLM(
        checkpoints["llama"],
        dtype="float32",
        skip_tokenizer_init=True,
        max_model_len=128,
        kv_cache_memory_bytes=8 << 20,
        tensor_parallel_size=2,
    )
    try:
        ranks = llm.collective_rpc(lambda worker: worker.config.parallel_config.rank)
        assert ranks == [0, 1]
        layer = "model.layers.0.mlp.down_proj"
        sizes = llm.collective_rpc(
            lambda worker: worker.model_runner.model.get_submodule(layer).input_size_per_partition
        )
        assert sizes == [64, 64]  # intermediate 128 split in two: each rank holds its half
        with pytest.raises(RuntimeError, match="collective_rpc failed on worker rank 0"):
            llm.collective_rpc("no_such_method")
        assert llm.collective_rpc(lambda worker: 1) == [1, 1]  # a failed call leaves the workers serving
    finally:
        llm.llm_engine.engine_core.shutdown()


@pytest.mark.slow
def test_smollm2_tp3_matches_tp1(smollm2_path: str, smollm2_prompt_ids: list[list[int]]) -> None:
    """SmolLM2-135M: 9 query heads / 3 KV heads, one KV head per rank at tp=3 (the packed GGUF weights are
    dequantized for tensor parallelism, so tp=1 dequantizes too)."""
    prompts = smollm2_prompt_ids[:4]
    kw = {
        "max_model_len": 512,
        "kv_cache_memory_bytes": 64 << 20,
        "gguf_dequantize": True,
        "max_num_batched_tokens": 256,
    }
    ref = run_engine(smollm2_path, prompts, max_tokens=16, **kw)
    got = run_engine(smollm2_path, prompts, max_tokens=16, tensor_parallel_size=3, **kw)
    assert_same_outputs(ref, got)


@pytest.mark.parametrize("variant", VARIANTS)
def test_pp2_matches_tp1(variant: str, checkpoints: dict[str, str], references: dict[str, list]) -> None:
    """Two stages of one layer each: activations and residual passed on, sampled ids passed back."""
    got = run_engine(checkpoints[variant], tiny_prompts(), pipeline_parallel_size=2)
    assert_same_outputs(references[variant], got)


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_tp2_pp2_matches_tp1(variant: str, checkpoints: dict[str, str], references: dict[str, list]) -> None:
    got = run_engine(checkpoints[variant], tiny_prompts(), tensor_parallel_size=2, pipeline_parallel_size=2)
    assert_same_outputs(references[variant], got)


@pytest.mark.slow
def test_pp2_tied_embeddings(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Tied LM head: the last stage holds the embedding too (loaded from the same checkpoint tensor)."""
    path = str(tmp_path_factory.mktemp("tied"))
    make_tiny_hf_model("llama3_tied", path)
    assert_same_outputs(run_engine(path, tiny_prompts()), run_engine(path, tiny_prompts(), pipeline_parallel_size=2))


def test_tp_that_does_not_divide_the_heads_is_refused(smollm2_path: str) -> None:
    from pagedllm.engine.arg_utils import EngineArgs

    with pytest.raises(ValueError, match="tensor_parallel_size: 2 does not divide the model's 9 attention heads"):
        EngineArgs(model=smollm2_path, tensor_parallel_size=2, device="cpu").create_engine_config()


def test_worker_start_up_error_reaches_the_caller(checkpoints: dict[str, str]) -> None:
    """A worker that fails while loading: the caller gets its error message and rank, no worker is left."""
    import psutil

    before = {p.pid for p in psutil.Process().children()}
    with pytest.raises(RuntimeError, match=r"worker rank \d failed during start-up: .*no \*\.bin files"):
        run_engine(checkpoints["llama"], tiny_prompts(), tensor_parallel_size=2, load_format="pt")
    left = [p for p in psutil.Process().children() if p.pid not in before and p.status() != psutil.STATUS_ZOMBIE]
    assert not [p for p in left if "resource_tracker" not in " ".join(p.cmdline())]


def test_pp2_bf16_matches_tp1(checkpoints: dict[str, str]) -> None:
    """bf16 stages compute what one process does, op for op, so the tokens are the same. (The GPU's
    memory-profiling forward on a later stage, which receives no activations, once started from float32
    zeros and failed against bf16 weights: that path runs on the device only, `tests/gpu/test_parallel_gpu.py`
    and W2 at pp=2 in `benchmarks/multi_gpu.sh`.)"""
    path = checkpoints[VARIANTS[0]]
    ref = run_engine(path, tiny_prompts(), dtype="bfloat16")
    got = run_engine(path, tiny_prompts(), dtype="bfloat16", pipeline_parallel_size=2)
    assert [list(o.token_ids) for o in got] == [list(o.token_ids) for o in ref]
