"""The copy-engine path's norm kernel (`ce_allreduce.recv_add_norm`) under the Triton interpreter, against
`triton_ops.fused_add_rms_norm` of the rank-order sum (what NCCL's all-reduce then the norm compute), bit for bit.
Run by `test_ce_allreduce.py` in a subprocess (TRITON_INTERPRET must be set before triton is imported):

    TRITON_INTERPRET=1 python tests/distributed/ce_interpret_check.py   # prints one JSON object

The flags are set before the launch (the interpreter runs programs one after another: a flag still waited on
would spin forever), at the epoch, one epoch ahead, and one ahead across the 2^30 wrap. float16 and float32
only: the interpreter rounds float32 to bfloat16 by truncation, in both kernels' casts alike."""

from __future__ import annotations

import json
import os
import sys

import torch


def run() -> dict[str, bool]:
    from pagedllm.distributed import ce_allreduce as ce
    from pagedllm.model_executor.layers import triton_ops

    res: dict[str, bool] = {}
    gen = torch.Generator().manual_seed(5)
    for dtype in (torch.float16, torch.float32):
        for rows, hidden, step in ((37, 96, 10), (5, 64, 1024)):
            x0 = torch.randn(rows, hidden, generator=gen).to(dtype)
            x1 = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype)
            residual = torch.randn(rows, hidden, generator=gen).to(dtype)
            weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
            want = triton_ops.fused_add_rms_norm((x0.float() + x1.float()).to(dtype), residual, weight, 1e-5)
            for flags_at, epoch in ((7, 7), (8, 7), (0, ce.EPOCH_MOD - 1)):
                flags = torch.full((4,), flags_at, dtype=torch.int32)
                for rank, own, peer in ((0, x0, x1), (1, x1, x0)):
                    recv = torch.cat([peer, torch.zeros(3, hidden, dtype=dtype)])  # (a slot has spare rows)
                    got = ce.recv_add_norm(own, recv, residual, weight, 1e-5, flags, epoch, step, rank, 4)
                    key = f"{str(dtype)[6:]} rows={rows} hidden={hidden} step={step} flag={flags_at} rank={rank}"
                    res[key] = torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    return res


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1 (set before triton is imported)")
    print(json.dumps(run()))
