"""Run under the Triton interpreter by tests/model_executor/test_gguf_triton.py (and on a GPU by
tests/gpu/test_gguf_gpu.py): the GLU int8 GEMV (`gguf_triton.gguf_glu_gemv`) against the two launches it
replaces, the GEMV of the merged gate/up weight then `triton_ops.silu_and_mul` with its q8 twin: the result and
the twin bit for bit, each pair-layout type, one and three rows, with and without the input's own q8 twin.
Prints "ok" (an AssertionError names the case)."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType

from pagedllm.model_executor.layers import triton_ops
from pagedllm.model_executor.layers.quantization import act_twin
from pagedllm.model_executor.layers.quantization import gguf as gq
from pagedllm.model_executor.layers.quantization import gguf_triton as gt
from tests.model_executor.gguf_triton_check import random_blocks


def check(device: str = "cpu", dtype: torch.dtype = torch.float16, inter: int = 64, k: int = 256) -> None:
    rng = np.random.default_rng(0)
    g = torch.Generator().manual_seed(0)
    for name in ("Q4_0", "Q4_1", "Q4_K", "Q8_0"):
        raw = random_blocks(name, 2 * inter, k, rng)
        w = gt.prepare(gq.GGUFWeight(int(GGMLQuantizationType[name]), torch.from_numpy(raw), 2 * inter, k), device)
        for m in (1, 3):
            x = torch.randn(m, k, generator=g).to(device, dtype)
            for own_twin in (False, True):
                q8 = gt.quantize_q8(x) if own_twin else None
                assert gt.glu_gemv_usable(x, w)
                got = gt.gguf_glu_gemv(x, w, q8)
                ref = triton_ops.silu_and_mul(gq.gguf_matmul(x, [w]), "q8")
                case = f"{name} m={m} own_twin={own_twin}"
                assert torch.equal(got, ref), f"{case}: the result"
                tg, tr = act_twin.twin_of(got), act_twin.twin_of(ref)
                assert isinstance(tg, act_twin.Q8Act) and isinstance(tr, act_twin.Q8Act)
                for a, b, what in zip(tg, tr, ("q", "d", "s"), strict=True):
                    assert torch.equal(a, b), f"{case}: the twin's {what}"


if __name__ == "__main__":
    check()
    print("ok")
