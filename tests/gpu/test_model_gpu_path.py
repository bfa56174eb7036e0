"""The whole GPU path of the model definitions -- Triton attention backend, fused RMSNorm / SiLU-mul, RoPE
fused with the KV-cache write (PAGEDLLM_FUSED_ROPE_CACHE, on and off) -- against HF transformers' forward on
tiny random float32 checkpoints: prefill, then single-token decodes, then a chunked prefill.

Runs on the GPU (`pytest -m gpu`), and on the CPU under the Triton interpreter (TRITON_INTERPRET=1), where
the CUDA-only dispatch is forced onto the CPU tensors.
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.triton_env import DEVICE, INTERPRET, require_triton_device  # noqa: E402

pytestmark = pytest.mark.gpu

require_triton_device()

from pagedllm.attention.backends.triton_attn import TritonAttentionImpl  # noqa: E402
from pagedllm.model_executor.layers import triton_ops  # noqa: E402
from pagedllm.model_executor.model_loader import load_model  # noqa: E402
from tests.utils_model import TINY_VARIANTS, VOCAB, PagedModelRunner, make_model_config, make_tiny_hf_model  # noqa: E402

SEQ_LEN, PREFILL = 40, 30
ATOL = 2e-4


@pytest.fixture
def gpu_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDLLM_ATTENTION_BACKEND", "TRITON")
    if INTERPRET:
        monkeypatch.setattr(triton_ops, "use_triton_ops", lambda x: True)


@pytest.mark.parametrize("fused", [True, False], ids=["switches-on", "switches-off"])
@pytest.mark.parametrize("variant", list(TINY_VARIANTS))
def test_gpu_path_matches_hf(
    variant: str,
    fused: bool,
    gpu_path: None,
    tmp_path,  # noqa: ANN001
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fused_cache = fused
    monkeypatch.setenv("PAGEDLLM_FUSED_ROPE_CACHE", "1" if fused else "0")
    hf = make_tiny_hf_model(variant, tmp_path)
    ours = load_model(make_model_config(str(tmp_path), hf.config), "auto", torch.device(DEVICE))
    impls = [m.impl for m in ours.modules() if hasattr(m, "impl")]
    assert impls and all(isinstance(i, TritonAttentionImpl) and i.fuses_rotary == fused_cache for i in impls)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (SEQ_LEN,), generator=g)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0].float()

    runner = PagedModelRunner(ours, num_blocks=4, block_size=16)
    out = [runner.step(ids[:PREFILL])] + [runner.step(ids[i : i + 1]) for i in range(PREFILL, SEQ_LEN)]
    torch.testing.assert_close(torch.cat(out).cpu(), ref, atol=ATOL, rtol=0)

    chunked = PagedModelRunner(ours, num_blocks=4, block_size=16)  # a fresh cache, chunks over a cached prefix
    out = [chunked.step(ids[a:b]) for a, b in ((0, 13), (13, 27), (27, 40))]
    torch.testing.assert_close(torch.cat(out).cpu(), ref, atol=ATOL, rtol=0)
