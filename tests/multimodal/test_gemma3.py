"""Gemma 3 (tiny random checkpoint with the real Gemma3Processor / image processor, SigLIP tower, sliding-window
and global layers): greedy outputs equal HF transformers' in float32 for prompts with 0, 1 and 2 images
batched, with the bidirectional attention over each image's tokens; `disable_chunked_mm_input` forced on
(a chunk boundary that would fall inside an image moves before it); prefix caching keyed by the image,
including a hit that ends inside an image."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.hf_utils import compare_greedy
from tests.multimodal.tiny_vlm import hf_mm_greedy, hf_mm_logprobs_fn, make_tiny_gemma3, random_image

MAX_TOKENS = 10
BUDGET = 20
"""Step token budget: an image is 18 tokens (begin, 16 image tokens, end), so most chunk boundaries of a
budget-sized split would fall inside an image."""
IMG = "<start_of_image>"


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):  # noqa: ANN001, ANN201
    torch.set_num_threads(2)
    path = tmp_path_factory.mktemp("gemma3")
    hf, proc = make_tiny_gemma3(path)
    return str(path), hf, proc


@pytest.fixture(scope="module")
def gemma3_llm(tiny_gemma3):  # noqa: ANN001, ANN201
    path, _, _ = tiny_gemma3
    return LLM(
        path,
        dtype="float32",
        max_model_len=256,
        kv_cache_memory_bytes=8 << 20,
        max_num_batched_tokens=BUDGET,
        block_size=16,
        enable_prefix_caching=True,
    )


@pytest.fixture(scope="module")
def global_gemma3(tmp_path_factory):  # noqa: ANN001, ANN201
    """Global layers only (prefix caching is not used with sliding-window layers)."""
    path = tmp_path_factory.mktemp("gemma3_global")
    hf, proc = make_tiny_gemma3(path, all_global=True)
    llm = LLM(
        str(path),
        dtype="float32",
        max_model_len=256,
        kv_cache_memory_bytes=8 << 20,
        max_num_batched_tokens=BUDGET,
        block_size=16,
        enable_prefix_caching=True,
    )
    return llm, hf, proc


def _greedy(n: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0)


def _check(hf, proc, text: str, images: list, out) -> None:  # noqa: ANN001
    """Greedy tokens equal HF's (numerical policy) and, up to the first divergence, each sampled token's
    logprob equals HF's teacher-forced one within 1e-3."""
    inputs = dict(proc(text=[text], images=images or None, return_tensors="pt"))
    ids = inputs["input_ids"][0].tolist()
    assert list(out.prompt_token_ids) == ids
    got = list(out.outputs[0].token_ids)
    ref = hf_mm_greedy(hf, inputs, len(got))
    lp_fn = hf_mm_logprobs_fn(inputs)
    compare_greedy(hf, ids, got, ref, torch.float32, lp_fn)
    n = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), len(got))
    ref_lp = lp_fn(hf, ids + ref[: max(n - 1, 0)])[len(ids) - 1 :]
    for i in range(n):
        ours = out.outputs[0].logprobs[i][got[i]].logprob
        assert abs(ours - float(ref_lp[i, got[i]])) < 1e-3, (i, ours, float(ref_lp[i, got[i]]))


def test_whole_items_forced_on(gemma3_llm) -> None:  # noqa: ANN001
    core = gemma3_llm.llm_engine.engine_core.engine_core
    assert core.scheduler.config.disable_chunked_mm_input


def test_greedy_matches_hf_batched_0_1_2_images_images_never_split(tiny_gemma3, gemma3_llm) -> None:  # noqa: ANN001
    _, hf, proc = tiny_gemma3
    imgs = [random_image(1, 40, 60), random_image(2, 90, 50), random_image(3, 70, 70)]
    prompts = [
        ("w1 w2 w3 w4 w5 w6", []),
        (f"w3 {IMG} w7 w8", imgs[:1]),
        (f"w9 {IMG} w10 w11 {IMG} w12", imgs[1:]),
        (f"{IMG} w20", imgs[2:]),
    ]
    enc_before = gemma3_llm.llm_engine.engine_core.engine_core.scheduler.encoder
    cuts = enc_before.whole_item_cuts if enc_before is not None else 0
    outs = gemma3_llm.generate(
        [{"prompt": t, "multi_modal_data": {"image": im}} if im else t for t, im in prompts], _greedy(), use_tqdm=False
    )
    for (text, im), out in zip(prompts, outs):
        _check(hf, proc, text, im, out)
    # A budget-sized chunk would have ended inside an image: the scheduler moved the boundary before it.
    assert gemma3_llm.llm_engine.engine_core.engine_core.scheduler.encoder.whole_item_cuts > cuts


def test_image_attention_is_bidirectional(tiny_gemma3, gemma3_llm) -> None:  # noqa: ANN001
    """Without the image mask HF gives other outputs (so the comparison above tests the mask)."""
    _, hf, proc = tiny_gemma3
    img = random_image(4, 64, 64)
    inputs = dict(proc(text=[f"w5 {IMG} w6"], images=[img], return_tensors="pt"))
    causal = {k: v for k, v in inputs.items() if k != "token_type_ids"}
    with torch.inference_mode():
        a = hf(**inputs).logits[0, -1]
        b = hf(**causal).logits[0, -1]
    assert (a - b).abs().max() > 1e-3
    out = gemma3_llm.generate({"prompt": f"w5 {IMG} w6", "multi_modal_data": {"image": img}}, _greedy(), use_tqdm=False)
    _check(hf, proc, f"w5 {IMG} w6", [img], out[0])


def test_prefix_cache_keyed_by_image_and_hit_inside_an_image(global_gemma3) -> None:  # noqa: ANN001
    gemma3_llm, hf, proc = global_gemma3
    a, b = random_image(10, 64, 64), random_image(11, 50, 70)
    text = f"w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 {IMG} w30 w31 w32"
    out_a = gemma3_llm.generate({"prompt": text, "multi_modal_data": {"image": a}}, _greedy(), use_tqdm=False)[0]
    out_b = gemma3_llm.generate({"prompt": text, "multi_modal_data": {"image": b}}, _greedy(), use_tqdm=False)[0]
    assert out_a.prompt_token_ids == out_b.prompt_token_ids
    assert out_b.num_cached_tokens == 0  # the first block holds image tokens: no block is shared
    ta, tb = out_a.outputs[0].token_ids[0], out_b.outputs[0].token_ids[0]
    lp_a, lp_b = out_a.outputs[0].logprobs[0][ta].logprob, out_b.outputs[0].logprobs[0][tb].logprob
    assert ta != tb or abs(lp_a - lp_b) > 1e-3, "the image did not change the output"
    _check(hf, proc, text, [a], out_a)
    _check(hf, proc, text, [b], out_b)
    # Same text up to inside the image, same image, other text after it: the cached blocks end inside the
    # image (its tokens are at 12..27; one 16-token block is shared), the rest of the image is computed.
    other = text.replace("w30 w31", "w50 w51")
    out_c = gemma3_llm.generate({"prompt": other, "multi_modal_data": {"image": a}}, _greedy(), use_tqdm=False)[0]
    image_id = gemma3_llm.llm_engine.input_processor.mm_processor.image_token_id
    start = out_c.prompt_token_ids.index(image_id)
    assert start < out_c.num_cached_tokens < start + 16
    _check(hf, proc, other, [a], out_c)


def test_image_longer_than_the_budget_is_rejected(tiny_gemma3) -> None:  # noqa: ANN001
    path, _, _ = tiny_gemma3
    llm = LLM(path, dtype="float32", max_model_len=128, kv_cache_memory_bytes=4 << 20, max_num_batched_tokens=8)
    with pytest.raises(ValueError, match="disable_chunked_mm_input"):
        llm.generate({"prompt": f"w1 {IMG}", "multi_modal_data": {"image": random_image(0, 30, 30)}}, _greedy())
    assert len(llm.generate("w1 w2", _greedy(2), use_tqdm=False)[0].outputs[0].token_ids) == 2


def test_disable_chunked_mm_input_is_optional_for_other_models(tmp_path) -> None:  # noqa: ANN001
    """LLaVA (causal over its image tokens): off by default (images split across chunks), on when asked;
    the same greedy output either way."""
    from tests.multimodal.tiny_vlm import make_tiny_llava

    make_tiny_llava(tmp_path)
    img = random_image(5, 60, 60)
    prompt = {"prompt": "w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 <image> w11", "multi_modal_data": {"image": img}}
    outs = []
    for whole in (False, True):
        llm = LLM(
            str(tmp_path),
            dtype="float32",
            max_model_len=128,
            kv_cache_memory_bytes=4 << 20,
            max_num_batched_tokens=20,
            disable_chunked_mm_input=whole,
        )
        sched = llm.llm_engine.engine_core.engine_core.scheduler
        assert sched.config.disable_chunked_mm_input is whole
        outs.append(llm.generate(prompt, _greedy(), use_tqdm=False)[0].outputs[0].token_ids)
        assert (sched.encoder.whole_item_cuts > 0) is whole  # the 16-token image at 10..25 vs a 20-token step
    assert outs[0] == outs[1]
