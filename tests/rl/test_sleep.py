"""Sleep levels 0/1/2 and wake_up(tags) on the CPU (acceptance 1)."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM
from pagedllm.engine.controls import EngineSleepingError
from pagedllm.inputs import TokensPrompt
from tests.rl.conftest import ENGINE_KW
from tests.rl.helpers import GREEDY, assert_same, keys, run
from tests.utils_model import make_tiny_hf_model


@pytest.fixture(scope="module")
def llm_a(tiny_ckpts: tuple[str, str]) -> LLM:
    return LLM(tiny_ckpts[0], **ENGINE_KW)


@pytest.fixture(scope="module")
def ref_a(llm_a: LLM, rl_prompts: list[list[int]]) -> list:
    return run(llm_a, rl_prompts)


def _device_bytes(llm: LLM) -> int:
    """Bytes held by the model's parameters, buffers, packed weights and KV cache."""
    model = llm.apply_model(lambda m: m)[0]
    runner = llm.collective_rpc(lambda w: w.model_runner)[0]
    seen: dict[int, int] = {}
    for t in [*model.parameters(), *model.buffers(), *runner.kv_caches.values()]:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    n_packed = sum(1 for m in model.modules() if getattr(m, "packed_weight", None) is not None)
    return sum(seen.values()) + n_packed


def test_sleep1_releases_and_wakes_to_same_outputs(llm_a: LLM, ref_a: list, rl_prompts: list[list[int]]) -> None:
    before = _device_bytes(llm_a)
    assert not llm_a.is_sleeping()
    llm_a.sleep(level=1)
    assert llm_a.is_sleeping()
    assert _device_bytes(llm_a) == 0 < before  # every weight, buffer and KV storage released
    with pytest.raises(EngineSleepingError, match="sleeping"):
        run(llm_a, rl_prompts)
    with pytest.raises(ValueError, match="already asleep"):
        llm_a.sleep(level=1)
    llm_a.wake_up(tags=["weights"])  # RL pattern: weights first, KV cache later
    assert llm_a.is_sleeping()
    with pytest.raises(EngineSleepingError):
        run(llm_a, rl_prompts)
    llm_a.wake_up(tags=["kv_cache"])
    assert not llm_a.is_sleeping()
    assert _device_bytes(llm_a) == before
    assert_same(run(llm_a, rl_prompts), ref_a)


def test_sleep2_then_update_from_checkpoint(
    llm_a: LLM, ref_a: list, rl_prompts: list[list[int]], tiny_ckpts: tuple[str, str]
) -> None:
    llm_a.sleep(level=2)
    llm_a.wake_up()
    llm_a.update_weights({"update_info": {"checkpoint_path": tiny_ckpts[0]}})
    llm_a.finish_weight_update()
    assert_same(run(llm_a, rl_prompts), ref_a)


def test_sleep0_queues_then_finishes(llm_a: LLM, ref_a: list, rl_prompts: list[list[int]]) -> None:
    assert llm_a.reset_prefix_cache()  # the same computation as the reference (no cached prefixes): bitwise
    llm_a.sleep(level=0)
    assert llm_a.is_sleeping()
    with pytest.raises(RuntimeError, match="paused"):
        run(llm_a, rl_prompts)
    ids = llm_a.enqueue([TokensPrompt(prompt_token_ids=p) for p in rl_prompts], GREEDY)
    engine = llm_a.llm_engine
    for _ in range(5):  # the engine is stepped, but nothing is scheduled
        assert engine.step() == []
    assert engine.get_num_unfinished_requests() == len(rl_prompts)
    with pytest.raises(RuntimeError, match="paused"):
        llm_a.wait_for_completion(use_tqdm=False)
    llm_a.wake_up(tags=["scheduling"])
    assert not llm_a.is_sleeping()
    outs = llm_a.wait_for_completion(use_tqdm=False)
    assert [o.request_id for o in outs] == ids
    assert_same(keys(outs), ref_a)


def test_sleep_errors(llm_a: LLM, tiny_ckpts: tuple[str, str]) -> None:
    with pytest.raises(ValueError, match="level"):
        llm_a.sleep(level=3)
    with pytest.raises(ValueError, match="unknown tag"):
        llm_a.wake_up(tags=["weights", "nope"])
    llm_a.enqueue([TokensPrompt(prompt_token_ids=[1, 2, 3])], GREEDY)
    with pytest.raises(ValueError, match="unfinished"):
        llm_a.sleep(level=1)  # would discard the running request's KV cache
    assert len(llm_a.wait_for_completion(use_tqdm=False)) == 1
    kw = {k: v for k, v in ENGINE_KW.items() if k != "enable_sleep_mode"}
    plain = LLM(tiny_ckpts[1], **kw)
    with pytest.raises(ValueError, match="enable_sleep_mode"):
        plain.sleep(level=1)


@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_sleep1_bf16_packed_weights(dtype: str, rl_prompts: list[list[int]], tmp_path) -> None:  # noqa: ANN001
    """bf16 on the CPU: linear weights are oneDNN-packed (opaque tensors); level 1 keeps them aside,
    level 2 + update_weights repacks them; outputs are identical throughout."""
    torch.set_num_threads(2)
    make_tiny_hf_model("llama3_tied", tmp_path, seed=3)
    llm = LLM(str(tmp_path), **{**ENGINE_KW, "dtype": dtype})
    ref = run(llm, rl_prompts)
    llm.sleep(level=1)
    llm.wake_up()
    assert_same(run(llm, rl_prompts), ref)
    llm.sleep(level=2)
    llm.wake_up()
    llm.update_weights({"update_info": {"checkpoint_path": str(tmp_path)}})
    assert_same(run(llm, rl_prompts), ref)


def test_sleep_with_async_ngram_speculation(tiny_ckpts: tuple[str, str], rl_prompts: list[list[int]]) -> None:
    """Speculation's own state (the device histories, the verification graphs where there are any) survives a
    sleep / wake cycle: the same greedy outputs before and after."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = LLM(tiny_ckpts[0], **ENGINE_KW, speculative_config=spec, async_scheduling=True)
    ref = run(llm, rl_prompts)
    llm.sleep(level=1)
    llm.wake_up()
    assert_same(run(llm, rl_prompts), ref)
