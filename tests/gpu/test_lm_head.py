"""The LM head on the GPU returns float32 logits for bf16/fp16 activations (the GEMM's accumulators, not
rounded to 16 bits), equal to a float64 product of the same 16-bit operands up to f32 accumulation."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from pagedllm.model_executor.layers.vocab_embedding import ParallelLMHead  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp32_logits(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    head = ParallelLMHead(1000, 256, params_dtype=dtype).cuda()
    head.weight.data.normal_(0, 1)
    h = torch.randn(37, 256, dtype=dtype, device="cuda")
    logits = head.compute_logits(h)
    assert logits.dtype == torch.float32 and logits.shape == (37, 1000)
    ref = h.double() @ head.weight[:1000].double().t()
    assert (logits.double() - ref).abs().max().item() < 1e-3
    # Rounded to 16 bits the error would be ~ulp(|logit|) = several 1e-2 here.
    assert (logits.double() - ref).abs().max().item() < (logits.to(dtype).double() - ref).abs().max().item()
