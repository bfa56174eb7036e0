"""Issue 27 on the GPU: the tiny LLaVA / Qwen2-VL / Qwen2.5-VL checkpoints of `tests/multimodal/` in
float32 on CUDA with the defaults there (decode CUDA graphs, async scheduling): prompts with 0, 1 and 2
images batched, an 8-token step budget (chunks split inside every image), 32 output tokens (the decodes run
as graph replays; M-RoPE decodes replay with their shifted positions); each greedy output equal to HF
transformers' on the same GPU by the numerical-comparison policy."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from pagedllm import LLM, SamplingParams  # noqa: E402
from tests.hf_utils import compare_greedy  # noqa: E402
from tests.multimodal.test_vlm_correctness import FAMILIES  # noqa: E402
from tests.multimodal.tiny_vlm import hf_mm_greedy, hf_mm_logprobs_fn, random_image  # noqa: E402


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_vlm_greedy_matches_hf_on_gpu_with_graphs(family: str, tmp_path: Any) -> None:
    build, ph = FAMILIES[family]
    hf, proc = build(tmp_path)
    hf = hf.to("cuda")
    imgs = [random_image(1, 100, 80), random_image(2, 130, 90), random_image(3, 170, 150), random_image(4, 60, 200)]
    prompts = [
        ("w1 w2 w3 w4 w5 w6", []),
        (f"w3 {ph} w7 w8", imgs[:1]),
        (f"w9 {ph} w10 w11 {ph} w12", imgs[1:3]),
        (f"{ph} w13", imgs[3:]),
        ("w20 w21", []),
    ]
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=256, gpu_memory_utilization=0.3, max_num_batched_tokens=8)
    assert llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.cuda_graphs is not None
    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outs = llm.generate(
        [{"prompt": t, "multi_modal_data": {"image": im}} if im else t for t, im in prompts], sp, use_tqdm=False
    )
    for (text, im), out in zip(prompts, outs):
        inputs = dict(proc(text=[text], images=im or None, return_tensors="pt"))
        ids = inputs["input_ids"][0].tolist()
        ref = hf_mm_greedy(hf, inputs, 32)
        compare_greedy(hf, ids, list(out.outputs[0].token_ids), ref, torch.float32, hf_mm_logprobs_fn(inputs))


@pytest.mark.parametrize("all_global", [False, True])
def test_gemma3_greedy_and_logprobs_match_hf_on_gpu(all_global: bool, tmp_path: Any) -> None:
    """Gemma 3 (bidirectional attention over each image in the Triton kernel's key-limit variant; sliding-window
    and global layers, or global only with prefix caching): 0, 1 and 2 images batched under a 20-token budget
    (chunk boundaries move before images), then a prefix-cache hit that ends inside an image."""
    from tests.multimodal.test_gemma3 import IMG, _check, _greedy
    from tests.multimodal.tiny_vlm import make_tiny_gemma3

    hf, proc = make_tiny_gemma3(tmp_path, all_global=all_global)
    hf = hf.to("cuda")
    imgs = [random_image(1, 100, 80), random_image(2, 130, 90), random_image(3, 170, 150), random_image(4, 60, 200)]
    prompts = [
        ("w1 w2 w3 w4 w5 w6", []),
        (f"w3 {IMG} w7 w8", imgs[:1]),
        (f"w9 {IMG} w10 w11 {IMG} w12", imgs[1:3]),
        (f"{IMG} w13", imgs[3:]),
        ("w20 w21", []),
    ]
    llm = LLM(
        str(tmp_path),
        dtype="float32",
        max_model_len=256,
        gpu_memory_utilization=0.3,
        max_num_batched_tokens=20,
        block_size=16,
        enable_prefix_caching=True,
    )
    core = llm.llm_engine.engine_core.engine_core
    assert core.scheduler.config.disable_chunked_mm_input
    outs = llm.generate(
        [{"prompt": t, "multi_modal_data": {"image": im}} if im else t for t, im in prompts],
        _greedy(32),
        use_tqdm=False,
    )
    for (text, im), out in zip(prompts, outs):
        _check(hf, proc, text, im, out)
    assert core.scheduler.encoder.whole_item_cuts > 0
    if all_global:
        text = f"w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 {IMG} w30 w31 w32"
        llm.generate({"prompt": text, "multi_modal_data": {"image": imgs[0]}}, _greedy(), use_tqdm=False)
        other = text.replace("w30 w31", "w50 w51")
        out = llm.generate({"prompt": other, "multi_modal_data": {"image": imgs[0]}}, _greedy(), use_tqdm=False)[0]
        assert 11 < out.num_cached_tokens < 27  # the hit ends inside the image (tokens 11..26)
        _check(hf, proc, other, [imgs[0]], out)
