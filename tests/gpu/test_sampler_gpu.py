"""The sampler on the GPU (issue 3, "Sampling on the GPU"): a step with top-k, top-p, min-p, logprobs,
logit bias, allowed token ids, bad words, min_tokens and seeded rows runs without one device
synchronization (torch.cuda sync debug mode raises on any), and the CUDA top-k/top-p (one sort) keeps
exactly the tokens the CPU path (topk candidates) keeps. Penalties are left out: they make the engine
step synchronously by design."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from pagedllm import SamplingParams  # noqa: E402
from pagedllm.sample.sampler import Sampler  # noqa: E402
from pagedllm.sample.top_k_top_p import apply_top_k_top_p  # noqa: E402
from pagedllm.worker.sampling_batch import build_sampling_metadata  # noqa: E402

V = 32_000


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=0.8, top_k=50),
        SamplingParams(temperature=0.9, top_p=0.9),
        SamplingParams(temperature=1.0, top_k=100, top_p=0.8, min_p=0.02),
        SamplingParams(temperature=0.6, logprobs=5, logprob_token_ids=[7, 11]),
        SamplingParams(temperature=0.0, logit_bias={3: 5.0, 9: -2.0}, logprobs=2),
        SamplingParams(temperature=1.0, allowed_token_ids=[1, 2, 3, 4, 5]),
        SamplingParams(temperature=0.5, bad_words_token_ids=[[5, 6], [8]]),
        SamplingParams(temperature=0.5, min_tokens=4, stop_token_ids=[0, 1]),
        SamplingParams(temperature=0.9, top_p=0.5, seed=123),
    ]


def test_sampler_step_has_no_device_sync() -> None:
    params = _params()
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(len(params), V, generator=g) * 4).cuda()
    outputs = [[5] if sp.bad_words_token_ids else [] for sp in params]
    gens = {i: torch.Generator(device="cuda").manual_seed(sp.seed) for i, sp in enumerate(params) if sp.seed}
    md = build_sampling_metadata(params, V, [[1, 2]] * len(params), outputs, gens, device="cuda")
    sampler = Sampler()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = sampler(logits.clone(), md)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ids = out.sampled_token_ids.cpu()
    assert ids[7].item() in (1, 2, 3, 4, 5)
    assert ids[8].item() != 8 and ids[9].item() not in (0, 1)
    assert ids[0].item() == int(logits[0].argmax())
    lists = out.logprobs
    assert lists is not None and len(lists) == 2
    assert lists.token_ids[0][0] == ids[5].item() and lists.token_ids[0][-2:] == [7, 11]


@pytest.mark.parametrize("flat", [False, True])
def test_cuda_top_k_top_p_keeps_what_the_cpu_path_keeps(flat: bool) -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(8, V, generator=g) * (1.0 if flat else 3.0)
    if not flat:
        logits[:, :30] += 8.0
    k = torch.tensor([0, 10, 0, 300, 50, 0, 1000, 0])
    p = torch.tensor([0.9, 1.0, 0.99, 0.3, 1.0, 0.5, 0.95, 1.0])
    cpu = apply_top_k_top_p(logits.clone(), k, p)
    gpu = apply_top_k_top_p(logits.cuda(), k.cuda(), p.cuda(), k.numpy(), p.numpy()).cpu()
    assert torch.equal(torch.isinf(cpu), torch.isinf(gpu))
    assert torch.equal(gpu[~torch.isinf(gpu)], logits[~torch.isinf(gpu)])
