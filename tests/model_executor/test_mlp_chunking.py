"""`chunk_mlps` (the model runner sets it on CUDA without LoRA): a batch above the chunk size goes through the
dense MLP blocks in chunks, which bounds the gate/up activation (the start-up profile's peak, taken from the KV
cache). Every row is the same product computed on fewer rows: the logits match the unchunked model."""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.model_executor.model_loader import load_model
from pagedllm.model_executor.models.llama import LlamaMLP, chunk_mlps
from tests.utils_model import VOCAB, PagedModelRunner, make_model_config, make_tiny_hf_model

torch.set_num_threads(2)


def test_chunked_mlps_keep_logits(tmp_path: Any) -> None:
    hf = make_tiny_hf_model("llama", tmp_path)
    model = load_model(make_model_config(str(tmp_path), hf.config), "auto", torch.device("cpu"))
    ids = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(5))
    want = PagedModelRunner(model).step(ids)
    mlps = [m for m in model.modules() if isinstance(m, LlamaMLP)]
    assert chunk_mlps(model, 7) == len(mlps) > 0
    rows: list[int] = []
    hook = mlps[0].gate_up_proj.register_forward_hook(lambda _m, args, _out: rows.append(args[0].shape[0]))
    got = PagedModelRunner(model).step(ids)
    hook.remove()
    assert rows == [7, 7, 7, 3]  # 24 tokens in chunks of 7
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    short = PagedModelRunner(model).step(ids[:7])  # up to the chunk size: one pass, as before
    chunk_mlps(model, 0)
    assert torch.equal(short, PagedModelRunner(model).step(ids[:7]))


def test_chunked_mlps_leave_the_whole_batch_to_a_deferred_reduction(tmp_path: Any) -> None:
    """Tensor parallelism with the fused all-reduce + norm (`defer_tp_reductions`): each chunk's down_proj output
    stays a partial sum and the norm after the block reduces the whole batch at once."""
    hf = make_tiny_hf_model("llama", tmp_path)
    model = load_model(make_model_config(str(tmp_path), hf.config), "auto", torch.device("cpu"))
    ids = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(5))
    want = PagedModelRunner(model).step(ids)
    rows: list[int] = []

    def reduce(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
        rows.append(x.shape[0])  # declines: the norm then reduces (identity at tp=1) and normalizes as usual

    model.model.defer_tp_reductions(reduce)
    chunk_mlps(model, 7)
    got = PagedModelRunner(model).step(ids)
    assert rows and set(rows) == {24}
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
