"""LLaVA-1.5 (tiny random checkpoint with the real LlavaProcessor / CLIP image processor): greedy outputs
equal HF transformers' in float32 for prompts with 0, 1 and 2 images of different sizes batched together,
with a step budget small enough that every image's placeholder run is split across chunks; the image
hash in the prefix-cache block hashes; the encoder cache; offline chat with image parts; bad input."""

from __future__ import annotations

import base64
import io

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.hf_utils import compare_greedy
from tests.multimodal.tiny_vlm import hf_mm_greedy, hf_mm_logprobs_fn, make_tiny_llava, random_image

MAX_TOKENS = 12
BUDGET = 8
"""Step token budget: each image is 16 placeholder tokens (56 px / 14 px patches, squared), so every
image's run is cut by at least one chunk boundary."""


@pytest.fixture(scope="module")
def tiny_llava(tmp_path_factory):  # noqa: ANN001, ANN201
    torch.set_num_threads(2)
    path = tmp_path_factory.mktemp("llava")
    hf, proc = make_tiny_llava(path)
    return str(path), hf, proc


@pytest.fixture(scope="module")
def llava_llm(tiny_llava):  # noqa: ANN001, ANN201
    path, _, _ = tiny_llava
    return LLM(
        path,
        dtype="float32",
        max_model_len=256,
        kv_cache_memory_bytes=8 << 20,
        max_num_batched_tokens=BUDGET,
        limit_mm_per_prompt={"image": 2},
    )


def _greedy(n: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _data_url(img) -> str:  # noqa: ANN001
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_greedy_matches_hf_batched_0_1_2_images_chunked_image_first(tiny_llava, llava_llm) -> None:  # noqa: ANN001
    _, hf, proc = tiny_llava
    imgs = [random_image(1, 40, 60), random_image(2, 90, 50), random_image(3, 70, 70)]
    prompts = [
        ("w1 w2 w3 w4 w5 w6", []),
        ("w3 <image> w7 w8", imgs[:1]),
        ("w9 <image> w10 w11 <image> w12", imgs[1:]),
        ("<image> w20", imgs[2:]),
    ]
    outs = llava_llm.generate(
        [{"prompt": t, "multi_modal_data": {"image": im}} if im else t for t, im in prompts], _greedy(), use_tqdm=False
    )
    for (text, im), out in zip(prompts, outs):
        inputs = dict(proc(text=[text], images=im or None, return_tensors="pt"))
        ids = inputs["input_ids"][0].tolist()
        assert list(out.prompt_token_ids) == ids
        ref = hf_mm_greedy(hf, inputs, MAX_TOKENS)
        compare_greedy(hf, ids, list(out.outputs[0].token_ids), ref, torch.float32, hf_mm_logprobs_fn(inputs))
    # The chunks really split images: 16-token placeholder runs against an 8-token budget.
    assert any(
        f.length > BUDGET
        for f in llava_llm.llm_engine.input_processor.mm_processor.process(prompts[1][0], {"image": imgs[:1]})[1]
    )


def test_prefix_cache_keyed_by_image_and_encoder_cache_hits(llava_llm) -> None:  # noqa: ANN001
    core = llava_llm.llm_engine.engine_core.engine_core
    text = "w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12 w13 w14 w15 w16 w17 w18 <image> w30 w31 w32 w33 " * 2
    text = text.replace("<image>", "w40", 1)  # one image, after 19 words (so the first block holds no image)
    a, b = random_image(10, 64, 64), random_image(11, 64, 64)
    out_a = llava_llm.generate({"prompt": text, "multi_modal_data": {"image": a}}, _greedy(), use_tqdm=False)[0]
    out_b = llava_llm.generate({"prompt": text, "multi_modal_data": {"image": b}}, _greedy(), use_tqdm=False)[0]
    assert out_a.prompt_token_ids == out_b.prompt_token_ids
    assert out_a.outputs[0].token_ids != out_b.outputs[0].token_ids
    offset = out_a.prompt_token_ids.index(llava_llm.llm_engine.input_processor.mm_processor.image_token_id)
    block = core.scheduler.block_size
    assert out_b.num_cached_tokens == offset // block * block  # the text before the image's block, no more
    enc = core.scheduler.encoder
    encoded, hits = enc.encoded, enc.hits
    out_a2 = llava_llm.generate({"prompt": text, "multi_modal_data": {"image": a}}, _greedy(), use_tqdm=False)[0]
    assert out_a2.outputs[0].token_ids == out_a.outputs[0].token_ids
    assert out_a2.num_cached_tokens > offset  # same text and image: blocks past the image are shared
    # A prompt repeating an image within it and a second request with that image at once: one encoder run.
    c = random_image(12, 50, 80)
    twice = {"prompt": "w5 <image> w6 <image> w7", "multi_modal_data": {"image": [c, c]}}
    once = {"prompt": "w8 <image> w9", "multi_modal_data": {"image": c}}
    llava_llm.generate([twice, once], _greedy(4), use_tqdm=False)
    assert enc.encoded - encoded == 1
    assert enc.hits - hits >= 2


def test_chat_with_image_url_equals_generate(tiny_llava, llava_llm) -> None:  # noqa: ANN001
    img = random_image(5, 80, 40)
    messages = [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": _data_url(img)}}, {"type": "text", "text": "w4 w5"}],
        }
    ]
    chat = llava_llm.chat(messages, _greedy(), use_tqdm=False)[0]
    text = "<|user|> <image>\nw4 w5 </s> <|assistant|>"
    gen = llava_llm.generate({"prompt": text, "multi_modal_data": {"image": img}}, _greedy(), use_tqdm=False)[0]
    assert chat.prompt_token_ids == gen.prompt_token_ids
    assert chat.outputs[0].token_ids == gen.outputs[0].token_ids


def test_bad_multimodal_input_is_a_clear_value_error(llava_llm) -> None:  # noqa: ANN001
    img = random_image(6, 30, 30)
    with pytest.raises(ValueError, match="limit_mm_per_prompt"):
        llava_llm.generate(
            {"prompt": "<image> <image> <image>", "multi_modal_data": {"image": [img] * 3}}, _greedy(), use_tqdm=False
        )
    with pytest.raises(ValueError, match="unreadable image"):
        llava_llm.generate({"prompt": "<image>", "multi_modal_data": {"image": b"not an image"}}, _greedy())
    with pytest.raises(ValueError, match="multi_modal_data: .*image"):
        llava_llm.generate({"prompt": "w1 w2", "multi_modal_data": {"image": img}}, _greedy(), use_tqdm=False)
    bad_url = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
    with pytest.raises(ValueError, match="unreadable image"):
        llava_llm.chat(bad_url, _greedy(), use_tqdm=False)
    # The engine still serves.
    assert len(llava_llm.generate("w1 w2", _greedy(2), use_tqdm=False)[0].outputs[0].token_ids) == 2


def test_image_on_text_only_model_is_rejected(tmp_path) -> None:  # noqa: ANN001
    from tests.utils_model import make_tiny_hf_model

    make_tiny_hf_model("llama", tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", skip_tokenizer_init=True, max_model_len=64, kv_cache_memory_bytes=4 << 20)
    with pytest.raises(ValueError, match="text-only"):
        llm.generate({"prompt": "hi", "multi_modal_data": {"image": random_image(0, 8, 8)}}, _greedy())


def test_preempted_image_requests_recompute_to_the_same_tokens(tiny_llava) -> None:  # noqa: ANN001
    path, hf, proc = tiny_llava
    llm = LLM(
        path,
        dtype="float32",
        max_model_len=96,
        num_gpu_blocks_override=7,
        schedule_conservativeness=0.0,  # admit all: the small cache preempts
        block_size=16,
        max_num_batched_tokens=BUDGET,
        enable_prefix_caching=False,
    )
    imgs = [random_image(20 + i, 50 + 10 * i, 60) for i in range(3)]
    texts = ["w1 <image> w2 w3", "<image> w4 w5 w6 w7", "w8 w9 <image> w10"]
    outs = llm.generate(
        [{"prompt": t, "multi_modal_data": {"image": im}} for t, im in zip(texts, imgs)], _greedy(24), use_tqdm=False
    )
    assert llm.llm_engine.engine_core.engine_core.scheduler.num_preemptions > 0
    for text, im, out in zip(texts, imgs, outs):
        inputs = dict(proc(text=[text], images=[im], return_tensors="pt"))
        ids = inputs["input_ids"][0].tolist()
        ref = hf_mm_greedy(hf, inputs, 24)
        compare_greedy(hf, ids, list(out.outputs[0].token_ids), ref, torch.float32, hf_mm_logprobs_fn(inputs))
