"""Weight updates A -> B through `checkpoint` and `gloo` (trainer in another process), atomic on bad input
(acceptance 2)."""

from __future__ import annotations

import multiprocessing
import socket
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedllm import LLM
from tests.rl.conftest import ENGINE_KW
from tests.rl.helpers import assert_same, run


def _state(path: str) -> dict[str, torch.Tensor]:
    return load_file(str(Path(path) / "model.safetensors"))


@pytest.fixture(scope="module")
def ref_b(tiny_ckpts: tuple[str, str], rl_prompts: list[list[int]]) -> list:
    """A fresh engine on checkpoint B."""
    return run(LLM(tiny_ckpts[1], **ENGINE_KW), rl_prompts)


@pytest.fixture(scope="module")
def llm(tiny_ckpts: tuple[str, str]) -> LLM:
    return LLM(tiny_ckpts[0], weight_transfer_config={"backend": "checkpoint"}, **ENGINE_KW)


def test_checkpoint_update_a_to_b_and_back(
    llm: LLM, tiny_ckpts: tuple[str, str], ref_b: list, rl_prompts: list[list[int]], tmp_path: Path
) -> None:
    ref_a = run(llm, rl_prompts)
    assert [t for t, _ in ref_a] != [t for t, _ in ref_b]  # the two checkpoints really differ
    state_b = _state(tiny_ckpts[1])
    bad_cases = {
        "unknown name": ({**state_b, "model.layers.1.mlp.bogus_proj.weight": torch.zeros(4, 4)}, "bogus_proj"),
        "bad shape": (
            {**state_b, "model.layers.0.self_attn.k_proj.weight": torch.zeros(3, 64)},
            "model.layers.0.self_attn.k_proj.weight",
        ),
    }
    for case, (state, name) in bad_cases.items():
        d = tmp_path / case.replace(" ", "_")
        d.mkdir()
        save_file(state, str(d / "model.safetensors"))
        with pytest.raises(ValueError, match=name):
            llm.update_weights({"update_info": {"checkpoint_path": str(d)}})
        assert llm.reset_prefix_cache()
        assert_same(run(llm, rl_prompts), ref_a)  # nothing was applied
    with pytest.raises(ValueError, match="checkpoint_path"):
        llm.update_weights({"update_info": {"checkpoint_path": str(tmp_path / "missing")}})
    llm.start_weight_update(is_checkpoint_format=True)
    llm.update_weights({"update_info": {"checkpoint_path": tiny_ckpts[1]}})
    llm.finish_weight_update()
    assert_same(run(llm, rl_prompts), ref_b)
    llm.update_weights({"update_info": {"checkpoint_path": tiny_ckpts[0]}})
    assert_same(run(llm, rl_prompts), ref_a)


def test_partial_and_internal_format_updates(
    llm: LLM, tiny_ckpts: tuple[str, str], ref_b: list, rl_prompts: list[list[int]], tmp_path: Path
) -> None:
    """Half of B's tensors, then the other half in the model's own (fused) naming: equals B."""
    state_b = _state(tiny_ckpts[1])
    names = sorted(state_b)
    first = {n: state_b[n] for n in names if ".layers.0." in n or "embed" in n}
    save_file(first, str(tmp_path / "model.safetensors"))
    llm.update_weights({"update_info": {"checkpoint_path": str(tmp_path)}})
    rest = {n: t for n, t in state_b.items() if n not in first}
    fused: dict[str, torch.Tensor] = {}
    for n, t in rest.items():
        if ".q_proj." in n:
            p = n.replace(".q_proj.", ".qkv_proj.")
            fused[p] = torch.cat([t, rest[n.replace("q_proj", "k_proj")], rest[n.replace("q_proj", "v_proj")]])
        elif ".gate_proj." in n:
            fused[n.replace(".gate_proj.", ".gate_up_proj.")] = torch.cat([t, rest[n.replace("gate_proj", "up_proj")]])
        elif not any(s in n for s in (".k_proj.", ".v_proj.", ".up_proj.")):
            fused[n] = t
    llm.start_weight_update(is_checkpoint_format=False)
    with pytest.raises(ValueError, match=r"proj.weight.*no such parameter"):  # HF names, internal format
        llm.collective_rpc("update_weights", args=({"checkpoint_path": tiny_ckpts[1]},))
    d = tmp_path / "internal"
    d.mkdir()
    save_file(fused, str(d / "model.safetensors"))
    llm.update_weights({"update_info": {"checkpoint_path": str(d)}})
    llm.finish_weight_update()
    assert_same(run(llm, rl_prompts), ref_b)
    llm.update_weights({"update_info": {"checkpoint_path": tiny_ckpts[0]}})  # back to A for other tests


# ---- gloo: the RL pattern, trainer in its own process ------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _trainer(init_info: dict, rounds: list[list[tuple[str, torch.Tensor]]], errors: multiprocessing.Queue) -> None:
    """The trainer process: joins as rank 0, then broadcasts each round's tensors."""
    try:
        from pagedllm.distributed.weight_transfer import GlooWeightTransferEngine

        group = GlooWeightTransferEngine.trainer_init(init_info)
        for tensors in rounds:
            GlooWeightTransferEngine.trainer_send_weights(iter(tensors), {"group": group})
        errors.put(None)
    except BaseException as e:  # noqa: BLE001 - reported to the test
        errors.put(repr(e))


def _update_info(tensors: list[tuple[str, torch.Tensor]]) -> dict:
    return {
        "names": [n for n, _ in tensors],
        "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in tensors],
        "shapes": [list(t.shape) for _, t in tensors],
    }


def test_gloo_update_from_trainer_process(
    tiny_ckpts: tuple[str, str], ref_b: list, rl_prompts: list[list[int]]
) -> None:
    llm = LLM(tiny_ckpts[0], weight_transfer_config={"backend": "gloo"}, **ENGINE_KW)
    ref_a = run(llm, rl_prompts)
    good = list(_state(tiny_ckpts[1]).items())
    # bf16 on the wire for the bad round; the engine's float32 parameters take the cast values.
    bad = [(n, t.to(torch.bfloat16)) for n, t in good[:3]] + [("model.layers.0.mlp.bogus.weight", torch.ones(2, 2))]
    init_info = {"master_address": "127.0.0.1", "master_port": _free_port(), "rank_offset": 1, "world_size": 2}
    ctx = multiprocessing.get_context("spawn")
    errors = ctx.Queue()
    proc = ctx.Process(target=_trainer, args=(init_info, [bad, good], errors), daemon=True)
    proc.start()
    try:
        llm.init_weight_transfer_engine({"init_info": init_info})
        with pytest.raises(ValueError, match="model.layers.0.mlp.bogus.weight"):
            llm.update_weights({"update_info": _update_info(bad)})
        assert llm.reset_prefix_cache()  # the reference's computation exactly (no cached prefixes): bitwise
        assert_same(run(llm, rl_prompts), ref_a)  # A intact
        llm.start_weight_update(is_checkpoint_format=True)
        llm.update_weights({"update_info": _update_info(good)})
        llm.finish_weight_update()
        assert_same(run(llm, rl_prompts), ref_b)
        assert errors.get(timeout=60) is None
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
