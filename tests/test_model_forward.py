"""Our model definitions against HF transformers' forward on tiny random checkpoints (float32, CPU)."""

from __future__ import annotations

import pytest
import torch

from pagedllm.model_executor.model_loader import load_model
from utils_model import TINY_VARIANTS, VOCAB, PagedModelRunner, make_model_config, make_tiny_hf_model

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
    hf, ours, ids, ref = _load_pair("qwen2", tmp_path)
    pt_dir = tmp_path / "pt"
    hf.save_pretrained(str(pt_dir), safe_serialization=False)
    if not list(pt_dir.glob("*.bin")):
        pytest.skip("this transformers version only writes safetensors")
    m = load_model(make_model_config(str(pt_dir), hf.config), "pt", torch.device("cpu"))
    torch.testing.assert_close(PagedModelRunner(m).step(ids), ref, atol=ATOL, rtol=0)


def test_unsupported_architecture() -> None:
    from pagedllm.model_executor.models import get_model_class

    with pytest.raises(ValueError, match="Qwen3ForCausalLM"):
        get_model_class(["GPT2LMHeadModel"])
