"""Tiny random vision-language checkpoints for the tests: a word-level tokenizer built here (with the
model's image tokens and a chat template), the family's real processor classes with small image sizes,
random float32 weights with a scaled-up output layer (peaked logits), all saved to a directory that
`LLM(path)` and `AutoProcessor.from_pretrained(path)` both read."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import torch

WORDS = [f"w{i}" for i in range(160)]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def word_tokenizer(specials: list[str]) -> Any:
    """A whitespace word-level fast tokenizer: <unk> <s> </s>, the chat role tags, `specials`, WORDS."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab: dict[str, int] = {}
    for t in ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", *specials, *WORDS]:
        vocab.setdefault(t, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    ft = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    ft.chat_template = CHAT_TEMPLATE
    return ft


def random_image(seed: int, w: int, h: int) -> Any:
    from PIL import Image

    arr = (np.random.RandomState(seed).rand(h, w, 3) * 255).astype("uint8")
    return Image.fromarray(arr)


def _peak(model: torch.nn.Module) -> None:
    torch.manual_seed(0)
    with torch.no_grad():
        head = model.get_output_embeddings()
        head.weight.mul_(10.0)


def make_tiny_llava(out_dir: str | os.PathLike[str], image_size: int = 56) -> tuple[Any, Any]:
    """LLaVA-1.5 shaped: CLIP tower (image_size / 14 squared patches per image, CLS dropped), projector,
    Llama. Returns (HF model, processor)."""
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    tok = word_tokenizer(["<image>"])
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    ip = CLIPImageProcessor(size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size})
    proc = LlavaProcessor(
        image_processor=ip,
        tokenizer=tok,
        patch_size=14,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        image_token="<image>",
        chat_template=CHAT_TEMPLATE,
    )
    tc = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(tok),
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    vc = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=2,
        image_size=image_size,
        patch_size=14,
        projection_dim=32,
    )
    cfg = LlavaConfig(
        vision_config=vc,
        text_config=tc,
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(cfg).eval()
    _peak(model)
    model.save_pretrained(out_dir)
    proc.save_pretrained(out_dir)
    return model, proc


@torch.inference_mode()
def hf_mm_greedy(model: Any, inputs: dict[str, torch.Tensor], max_new_tokens: int) -> list[int]:
    """HF `generate`, greedy, explicit all-ones attention mask, no EOS stop: exactly max_new_tokens."""
    from transformers import GenerationConfig

    inputs = {k: v.to(model.device) for k, v in inputs.items()}
    ids = inputs["input_ids"]
    gc = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None
    try:
        extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gc, **extra)
    finally:
        model.generation_config.eos_token_id = saved
    return out[0, ids.shape[1] :].tolist()


def hf_mm_logprobs_fn(inputs: dict[str, torch.Tensor]) -> Any:
    """A `compare_greedy` logprobs function that feeds the prompt's images too."""
    extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}

    @torch.inference_mode()
    def fn(model: Any, ids: list[int]) -> torch.Tensor:
        t = torch.tensor([ids], device=model.device)
        extra_dev = {k: v.to(model.device) for k, v in extra.items()}
        if "token_type_ids" in extra_dev:  # Gemma 3: the generated tokens are text (type 0)
            tt = extra_dev["token_type_ids"]
            extra_dev["token_type_ids"] = torch.nn.functional.pad(tt, (0, t.shape[1] - tt.shape[1]))
        logits = model(input_ids=t, attention_mask=torch.ones_like(t), **extra_dev).logits[0].float()
        return torch.log_softmax(logits, dim=-1)

    return fn


QWEN_SPECIALS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]


def make_tiny_qwen_vl(out_dir: str | os.PathLike[str], qwen25: bool) -> tuple[Any, Any]:
    """Qwen2-VL / Qwen2.5-VL shaped: 14 px patches merged 2x2, images resized to 4..36 merged tokens; the
    2.5 tower with one windowed (56 px windows: 2x2 merged tokens) and one full-attention block."""
    import transformers
    from transformers import Qwen2VLImageProcessor

    from pagedllm.multimodal.processing import load_hf_processor

    tok = word_tokenizer(QWEN_SPECIALS)
    tok.add_special_tokens({"additional_special_tokens": QWEN_SPECIALS})
    ip = Qwen2VLImageProcessor(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 36)
    text = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": len(tok),
        "max_position_embeddings": 512,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        "tie_word_embeddings": False,
    }
    if qwen25:
        vision = {
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": 64,
            "window_size": 56,
            "fullatt_block_indexes": [1],
            "hidden_act": "silu",
        }
        cfg_cls, model_cls = transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration
    else:
        vision = {"depth": 2, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "mlp_ratio": 2}
        cfg_cls, model_cls = transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_SPECIALS}
    cfg = cfg_cls(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = model_cls(cfg).eval()
    _peak(model)
    model.save_pretrained(out_dir)
    # The layout of the Qwen2-VL repos: the image processor's config names the processor class.
    tok.save_pretrained(out_dir)
    ip.save_pretrained(out_dir)
    path = os.path.join(out_dir, "preprocessor_config.json")
    with open(path) as f:
        pre = json.load(f)
    pre["processor_class"] = "Qwen2VLProcessor"
    with open(path, "w") as f:
        json.dump(pre, f)
    with open(os.path.join(out_dir, "chat_template.jinja"), "w") as f:
        f.write(CHAT_TEMPLATE)
    return model, load_hf_processor(str(out_dir))


GEMMA3_SPECIALS = ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]


def make_tiny_gemma3(
    out_dir: str | os.PathLike[str],
    image_size: int = 56,
    tokens_per_image: int = 16,
    sliding_window: int = 12,
    all_global: bool = False,
) -> tuple[Any, Any]:
    """Gemma 3 shaped: SigLIP tower (14 px patches, pooled to `tokens_per_image`), the Gemma3Processor with
    its real image processor, a Gemma 3 text decoder alternating sliding-window (window shorter than an
    image's run, so the window cuts into images) and global layers (`all_global`: global layers only, so
    that prefix caching, which sliding-window groups do not use, is on). Returns (HF model, processor)."""
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3ImageProcessor,
        Gemma3Processor,
        Gemma3TextConfig,
        SiglipVisionConfig,
    )

    tok = word_tokenizer(GEMMA3_SPECIALS)
    tok.add_special_tokens({"additional_special_tokens": GEMMA3_SPECIALS})
    names = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    tok._set_model_specific_special_tokens(names)  # what the Gemma 3 tokenizer config names (tok.boi_token, ...)
    ip = Gemma3ImageProcessor(size={"height": image_size, "width": image_size})
    proc = Gemma3Processor(image_processor=ip, tokenizer=tok, image_seq_length=tokens_per_image)
    proc.chat_template = CHAT_TEMPLATE
    ids = {t: tok.convert_tokens_to_ids(t) for t in GEMMA3_SPECIALS}
    tc = Gemma3TextConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        sliding_window=sliding_window,
        layer_types=["full_attention"] * 2 if all_global else ["sliding_attention", "full_attention"],
        tie_word_embeddings=False,
    )
    vc = SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=image_size,
        patch_size=14,
    )
    cfg = Gemma3Config(
        text_config=tc,
        vision_config=vc,
        mm_tokens_per_image=tokens_per_image,
        boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"],
        image_token_index=ids["<image_soft_token>"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # HF initializes the projection to zeros: random, so the image matters
        w = model.model.multi_modal_projector.mm_input_projection_weight
        w.copy_(torch.randn_like(w) * 0.5)
    _peak(model)
    model.save_pretrained(out_dir)
    proc.save_pretrained(out_dir)
    return model, proc
