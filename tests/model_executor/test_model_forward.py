"""Our model definitions against HF transformers' forward on tiny random checkpoints (float32, CPU)."""

from __future__ import annotations

import pytest
import torch

from pagedllm.model_executor.model_loader import load_model
from tests.utils_model import TINY_VARIANTS, VOCAB, PagedModelRunner, make_model_config, make_tiny_hf_model

torch.set_num_threads(2)

SEQ_LEN = 40
PREFILL = 30
ATOL = 1e-4


def _load_pair(variant: str, tmp_path):  # noqa: ANN001, ANN202
    hf = make_tiny_hf_model(variant, tmp_path)
    ours = load_model(make_model_config(str(tmp_path), hf.config), "auto", torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (SEQ_LEN,), generator=g)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0].float()
    return hf, ours, ids, ref


@pytest.mark.parametrize("variant", list(TINY_VARIANTS))
def test_prefill_matches_hf(variant: str, tmp_path) -> None:  # noqa: ANN001
    _, ours, ids, ref = _load_pair(variant, tmp_path)
    logits = PagedModelRunner(ours).step(ids)
    assert logits.shape == ref.shape
    assert ref.abs().max() > 1.0  # peaked logits, so a wrong forward can't hide in the noise
    torch.testing.assert_close(logits, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("variant", ["llama", "llama3_tied", "mistral_sliding", "qwen2_sliding", "qwen3_mqa"])
def test_prefill_then_decode_matches_hf(variant: str, tmp_path) -> None:  # noqa: ANN001
    _, ours, ids, ref = _load_pair(variant, tmp_path)
    runner = PagedModelRunner(ours, num_blocks=4, block_size=16)
    out = [runner.step(ids[:PREFILL])]
    for i in range(PREFILL, SEQ_LEN):
        out.append(runner.step(ids[i : i + 1]))
    torch.testing.assert_close(torch.cat(out), ref, atol=ATOL, rtol=0)


def test_chunked_prefill_matches_hf(tmp_path) -> None:  # noqa: ANN001
    """Prefill in chunks that attend to a cached prefix (and cross block boundaries)."""
    _, ours, ids, ref = _load_pair("mistral_sliding", tmp_path)
    runner = PagedModelRunner(ours, num_blocks=4, block_size=16)
    out = [runner.step(ids[a:b]) for a, b in ((0, 13), (13, 27), (27, 40))]
    torch.testing.assert_close(torch.cat(out), ref, atol=ATOL, rtol=0)


def test_dummy_load_is_deterministic(tmp_path) -> None:  # noqa: ANN001
    hf = make_tiny_hf_model("qwen3", tmp_path)
    cfg = make_model_config(str(tmp_path), hf.config)
    a = load_model(cfg, "dummy", torch.device("cpu"))
    b = load_model(cfg, "dummy", torch.device("cpu"))
    for (na, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), na
        if "norm" in na:
            assert torch.all(pa == 1)
        else:
            assert pa.abs().max() <= 1e-3
    logits = PagedModelRunner(a).step(list(range(10)))
    assert torch.isfinite(logits).all()


def test_bf16_close_to_fp32(tmp_path) -> None:  # noqa: ANN001
    hf, ours, ids, ref = _load_pair("llama", tmp_path)
    cfg = make_model_config(str(tmp_path), hf.config, dtype=torch.bfloat16)
    bf = load_model(cfg, "safetensors", torch.device("cpu"))
    assert next(bf.parameters()).dtype == torch.bfloat16
    logits = PagedModelRunner(bf).step(ids)
    assert (logits.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


def test_missing_weight_is_reported(tmp_path) -> None:  # noqa: ANN001
    from safetensors.torch import load_file, save_file

    hf = make_tiny_hf_model("llama", tmp_path)
    path = tmp_path / "model.safetensors"
    sd = load_file(str(path))
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, str(path), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.gate_up_proj\.weight"):
        load_model(make_model_config(str(tmp_path), hf.config), "auto", torch.device("cpu"))


def test_pt_format(tmp_path) -> None:  # noqa: ANN001
    """A sharded *.bin checkpoint with pytorch_model.bin.index.json."""
    import json

    hf, ours, ids, ref = _load_pair("qwen2", tmp_path)
    pt_dir = tmp_path / "pt"
    pt_dir.mkdir()
    sd = {k: v.clone() for k, v in hf.state_dict().items()}
    names = sorted(sd)
    shards = {"pytorch_model-00001-of-00002.bin": names[::2], "pytorch_model-00002-of-00002.bin": names[1::2]}
    weight_map = {}
    for fname, keys in shards.items():
        torch.save({k: sd[k] for k in keys}, pt_dir / fname)
        weight_map.update(dict.fromkeys(keys, fname))
    (pt_dir / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    m = load_model(make_model_config(str(pt_dir), hf.config), "auto", torch.device("cpu"))
    torch.testing.assert_close(PagedModelRunner(m).step(ids), ref, atol=ATOL, rtol=0)


@pytest.mark.slow  # CI time: run by hand (pytest -m slow)
def test_gguf_matches_transformers() -> None:
    """SmolLM2 Q4_1 GGUF: our dequantized, un-permuted weights equal transformers' GGUF loading bit for bit,
    and so do the logits (about 25 s)."""
    import os

    from transformers import AutoModelForCausalLM

    from pagedllm.transformers_utils.config import default_model_path, get_hf_config

    try:
        path = default_model_path()
    except RuntimeError:
        pytest.skip("default SmolLM2 GGUF not installed")
    model_dir = os.path.dirname(path)
    hf_config = get_hf_config(model_dir, path)
    cfg = make_model_config(model_dir, hf_config)
    cfg.gguf_file = path
    ours = load_model(cfg, "auto", torch.device("cpu"))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, gguf_file=os.path.basename(path), dtype=torch.float32)
    hf_sd = hf.state_dict()
    vocab = hf_config.vocab_size
    for name, p in ours.named_parameters():
        for fused, parts in (
            (".qkv_proj.", ("q_proj", "k_proj", "v_proj")),
            (".gate_up_proj.", ("gate_proj", "up_proj")),
        ):
            if fused in name:
                ref = torch.cat([hf_sd[name.replace(fused.strip("."), part)] for part in parts])
                break
        else:
            ref = hf_sd[name]
        assert torch.equal(p[: ref.shape[0]] if "embed_tokens" in name else p, ref), name
    assert torch.equal(ours.lm_head.weight[:vocab], hf_sd["lm_head.weight"])
    ids = torch.tensor([1, 504, 3458, 314, 4132, 282, 253, 1345, 30, 216, 504, 3458])
    with torch.no_grad():
        ref_logits = hf(ids[None]).logits[0]
    torch.testing.assert_close(PagedModelRunner(ours).step(ids), ref_logits, atol=2e-3, rtol=1e-4)


def test_unsupported_architecture() -> None:
    from pagedllm.model_executor.models import get_model_class

    with pytest.raises(ValueError, match="Qwen3ForCausalLM"):
        get_model_class(["NotARealModelForCausalLM"])


@pytest.mark.parametrize("variant", ["llama", "llama3_tied", "llama_linear_rope_bias"])
def test_rope_matches_hf(variant: str) -> None:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    from pagedllm.model_executor.layers.rotary_embedding import get_rope
    from pagedllm.transformers_utils.config import get_rope_params
    from tests.utils_model import tiny_hf_config

    cfg = tiny_hf_config(variant)
    hd = cfg.hidden_size // cfg.num_attention_heads
    theta, scaling = get_rope_params(cfg)
    rope = get_rope(hd, hd, cfg.max_position_embeddings, theta, scaling)
    pos = torch.tensor([0, 1, 5, 17, 63, 64, 200, 255])
    q = torch.randn(len(pos), 4 * hd)
    k = torch.randn(len(pos), 2 * hd)
    cos, sin = LlamaRotaryEmbedding(cfg)(q, pos[None])
    q_ref, k_ref = apply_rotary_pos_emb(
        q.view(1, -1, 4, hd).transpose(1, 2), k.view(1, -1, 2, hd).transpose(1, 2), cos, sin
    )
    q_out, k_out = rope(pos, q, k)
    assert torch.equal(q_out, q_ref.transpose(1, 2).reshape(len(pos), -1))
    assert torch.equal(k_out, k_ref.transpose(1, 2).reshape(len(pos), -1))


def test_rotary_embedding_is_shared_by_the_layers() -> None:
    """One rotary module (one cos/sin cache) for every layer of a model, counted once in its weight bytes; another
    base or scaling gets its own."""
    from pagedllm.model_executor.layers.rotary_embedding import get_rope
    from pagedllm.model_executor.model_loader.loader import build_model, weight_bytes
    from tests.utils_model import tiny_hf_config

    cfg = tiny_hf_config("llama")
    model = build_model(cfg, torch.float32, "cpu")
    ropes = {id(layer.self_attn.rotary_emb) for layer in model.model.layers}
    assert len(ropes) == 1 and len(model.model.layers) > 1
    rope = model.model.layers[0].self_attn.rotary_emb
    caches = {id(b) for n, b in model.named_buffers(remove_duplicate=False) if n.endswith("cos_sin_cache")}
    assert caches == {id(rope.cos_sin_cache)}
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())  # each shared buffer once
    assert weight_bytes(model) == params + buffers
    hd = rope.head_size
    assert get_rope(hd, hd, rope.max_position_embeddings, rope.base) is not get_rope(
        hd, hd, rope.max_position_embeddings, rope.base * 2
    )
    scaled = get_rope(hd, hd, rope.max_position_embeddings, rope.base, {"rope_type": "linear", "factor": 2.0})
    assert scaled is not get_rope(hd, hd, rope.max_position_embeddings, rope.base)
