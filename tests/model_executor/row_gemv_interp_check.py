"""The batch-1 row GEMV's fused variants with the Triton interpreter, run by `test_row_gemv_interpreted.py` in a
subprocess with TRITON_INTERPRET=1 (it must be set before triton is imported); prints "ok".

- The push path (`distributed/push_allreduce.py`), one process playing both ranks' buffers: the pushed bits, the
  receive buffer's halves by epoch parity, the sentinel written back, a NaN sent as another NaN, the norm's math.
- The gate/up GLU (`row_gemv(glu=True)`): equal to the plain GEMV followed by `silu_and_mul`'s arithmetic.
- Float32 output (`out_dtype`, the LM head's logits at one row): the float32 sums, with the bias, unrounded.

The interpreter rounds float32 to bfloat16 its own way, so results are compared within a bfloat16 step here; on
GPUs both are bit-identical to the unfused launches (tests/gpu/test_fused_allreduce_norm_gpu.py,
tests/gpu/test_fused_ops.py, and the push path's own self-check at start-up)."""

from __future__ import annotations

import torch

from pagedllm.distributed import push_allreduce
from pagedllm.model_executor.layers import triton_gemv


def check_push() -> None:
    torch.manual_seed(0)
    hidden, k, dt = 96, 128, torch.bfloat16
    recv = torch.full((2 * hidden,), push_allreduce.SENTINEL, dtype=torch.int16)
    epoch = torch.zeros(1, dtype=torch.int64)
    w = (torch.randn(hidden, k) / 8).to(dt)
    norm_w = (torch.rand(hidden) + 0.5).to(dt)
    block = 128
    for i in range(4):
        x = torch.randn(1, k).to(dt)
        if i == 3:
            x[0, 0] = float("nan")  # every output a NaN: sent as a NaN, never as the sentinel
        residual = torch.randn(1, hidden).to(dt)
        y = triton_gemv.row_gemv(x, w, push=(recv.data_ptr(), epoch))
        half = recv[(i % 2) * hidden : (i % 2 + 1) * hidden]
        other = recv[(1 - i % 2) * hidden : (2 - i % 2) * hidden]
        assert bool((other == push_allreduce.SENTINEL).all()), "the other half was written"
        if i == 3:
            assert bool(half.view(dt).isnan().all()) and not bool((half == push_allreduce.SENTINEL).any()), half
        else:
            assert torch.equal(half, y[0].view(torch.int16)), "the pushed bits are not the GEMV's output"
        out, res_out = torch.empty(1, hidden, dtype=dt), torch.empty(1, hidden, dtype=dt)
        push_allreduce._recv_add_norm_kernel[(1,)](
            y, residual, out, res_out, norm_w, recv, epoch, hidden, 1e-6, RANK=i % 2, BLOCK=block
        )
        assert bool((recv == push_allreduce.SENTINEL).all()), "the sentinel was not written back"
        assert int(epoch) == i + 1
        if i == 3:
            assert bool(out.isnan().all()) and bool(res_out.isnan().all())
            continue
        h = (y.float() * 2).to(dt).float() + residual.float()
        want = norm_w.float() * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        torch.testing.assert_close(res_out.float(), h, atol=0, rtol=2**-7)
        torch.testing.assert_close(out.float(), want, atol=1e-2, rtol=2**-6)


def check_glu() -> None:
    torch.manual_seed(1)
    for n, k in ((48, 128), (37, 96)):  # K a multiple of the K step, and not (masked loads)
        w = (torch.randn(2 * n, k) / 8).to(torch.bfloat16)
        x = torch.randn(1, k).to(torch.bfloat16)
        got = triton_gemv.row_gemv(x, w, glu=True)
        assert got.shape == (1, n)
        gu = triton_gemv.row_gemv(x, w).float()
        g, u = gu[:, :n], gu[:, n:]
        want = (g / (1 + torch.exp(-g))).to(torch.bfloat16).float() * u
        torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=2**-6)


def check_fp32_out() -> None:
    torch.manual_seed(2)
    for n, k in ((40, 128), (37, 96)):
        w = (torch.randn(n, k) / 8).to(torch.bfloat16)
        b = torch.randn(n).to(torch.bfloat16)
        x = torch.randn(1, k).to(torch.bfloat16)
        got = triton_gemv.row_gemv(x, w, b, out_dtype=torch.float32)
        assert got.dtype == torch.float32 and got.shape == (1, n)
        want = x.float() @ w.float().T + b.float()
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert not torch.equal(got, want.to(torch.bfloat16).float()), "rounded to bfloat16"


def main() -> None:
    check_push()
    check_glu()
    check_fp32_out()
    print("ok")


if __name__ == "__main__":
    main()
