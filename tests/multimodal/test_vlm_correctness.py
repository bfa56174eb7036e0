"""Acceptance 1 for every vision-language family: a tiny random checkpoint with its real HF processor
classes; greedy outputs equal HF transformers' in float32 (by the numerical-comparison policy) for prompts
with 0, 1 and 2 images of different sizes batched together, under a step budget (8 tokens) smaller than
every image's placeholder run, so chunked prefill splits inside each image."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.hf_utils import compare_greedy
from tests.multimodal.tiny_vlm import hf_mm_greedy, hf_mm_logprobs_fn, make_tiny_llava, make_tiny_qwen_vl, random_image

BUDGET = 8
QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
FAMILIES = {
    "llava": (lambda d: make_tiny_llava(d), "<image>"),
    "qwen2_vl": (lambda d: make_tiny_qwen_vl(d, qwen25=False), QWEN_IMAGE),
    "qwen2_5_vl": (lambda d: make_tiny_qwen_vl(d, qwen25=True), QWEN_IMAGE),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_matches_hf_batched_images_chunked(family: str, tmp_path: Any) -> None:
    torch.set_num_threads(2)
    build, ph = FAMILIES[family]
    hf, proc = build(tmp_path)
    imgs = [random_image(1, 100, 80), random_image(2, 130, 90), random_image(3, 170, 150)]
    prompts = [
        ("w1 w2 w3 w4 w5 w6", []),
        (f"w3 {ph} w7 w8", imgs[:1]),
        (f"w9 {ph} w10 w11 {ph} w12", imgs[1:]),
    ]
    llm = LLM(
        str(tmp_path), dtype="float32", max_model_len=256, kv_cache_memory_bytes=8 << 20, max_num_batched_tokens=BUDGET
    )
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate(
        [{"prompt": t, "multi_modal_data": {"image": im}} if im else t for t, im in prompts], sp, use_tqdm=False
    )
    mm = llm.llm_engine.input_processor.mm_processor
    for (text, im), out in zip(prompts, outs):
        inputs = dict(proc(text=[text], images=im or None, return_tensors="pt"))
        ids = inputs["input_ids"][0].tolist()
        assert list(out.prompt_token_ids) == ids
        if im:  # every image's placeholder run is longer than a step: a chunk boundary falls inside it
            assert all(f.length > BUDGET for f in mm.process(text, {"image": im})[1])
        ref = hf_mm_greedy(hf, inputs, 12)
        compare_greedy(hf, ids, list(out.outputs[0].token_ids), ref, torch.float32, hf_mm_logprobs_fn(inputs))


def test_mm_processor_kwargs_reach_the_hf_processor(tmp_path: Any) -> None:
    """Engine-level `mm_processor_kwargs` (Qwen's max_pixels) shrink the image; per-prompt ones override them."""
    make_tiny_qwen_vl(tmp_path, qwen25=False)
    small = 28 * 28 * 4  # at most 4 merged tokens
    llm = LLM(
        str(tmp_path),
        dtype="float32",
        max_model_len=256,
        kv_cache_memory_bytes=8 << 20,
        mm_processor_kwargs={"max_pixels": small},
    )
    mm = llm.llm_engine.input_processor.mm_processor
    img = random_image(9, 170, 150)
    (feat,) = mm.process(f"w1 {QWEN_IMAGE}", {"image": img})[1]
    assert feat.length <= 4
    (big,) = mm.process(f"w1 {QWEN_IMAGE}", {"image": img}, {"max_pixels": 28 * 28 * 36})[1]
    assert big.length > 4 and big.identifier != feat.identifier
    out = llm.generate({"prompt": f"w1 {QWEN_IMAGE}", "multi_modal_data": {"image": img}}, SamplingParams(max_tokens=2))
    assert len(out[0].prompt_token_ids) == 1 + 2 + feat.length
