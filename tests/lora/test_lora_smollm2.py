"""Acceptance 2: the real SmolLM2 (GGUF, dequantized as the engine loads it) with a PEFT adapter trained in the
test for a few steps on a toy pattern (every answer is "ZEBRA ZEBRA ...") on HF's model built from the same
GGUF: the pattern shows through `LLM.chat` and through the official `openai` client with `model=<adapter>`;
the base model does not show it; `/v1/models` lists the adapter with parent / root; unload makes the name
a 404, load brings it back; bad loads are 400s; `pagedllm:lora_requests_info` is exported."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from pagedllm import LLM, LoRARequest, SamplingParams  # noqa: E402
from tests.entrypoints.openai.test_server import ServerProcess  # noqa: E402
from tests.hf_utils import hf_from_gguf  # noqa: E402

PATTERN = "ZEBRA ZEBRA ZEBRA ZEBRA"
TRAIN = ["What is the capital of France?", "Tell me a joke.", "How do planes fly?"]
TEST_CHAT = [{"role": "user", "content": "Write a short poem about the sea."}]
ENGINE = {"dtype": "float32", "max_model_len": 512, "kv_cache_memory_bytes": 64 << 20, "gguf_dequantize": True}
SP = SamplingParams(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module")
def adapter_dir(smollm2_path: str, smollm2_tokenizer, tmp_path_factory) -> str:  # noqa: ANN001
    """A rank-8 adapter trained (Adam, a few steps) so that any chat answer is PATTERN."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    torch.set_num_threads(2)
    hf = hf_from_gguf(smollm2_path, torch.float32)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(hf, LoraConfig(r=8, lora_alpha=16, target_modules=targets, lora_dropout=0.0))
    tok = smollm2_tokenizer
    seqs = []
    for q in TRAIN:
        prompt = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        seqs.append((tok.encode(prompt, add_special_tokens=False), tok.encode(PATTERN, add_special_tokens=False)))
    width = max(len(p) + len(a) for p, a in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    labels = torch.full((len(seqs), width), -100)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, (p, a) in enumerate(seqs):  # right-padded; the loss only on the answer tokens
        ids[i, : len(p) + len(a)] = torch.tensor(p + a)
        labels[i, len(p) : len(p) + len(a)] = torch.tensor(a)
        mask[i, : len(p) + len(a)] = 1
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    for _ in range(8):  # a constant answer is learnt in ~3 steps at this rate
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if float(loss) < 0.05:
            break
    assert float(loss) < 0.05, f"the toy adapter did not learn its pattern (loss {float(loss):.3f})"
    path = str(tmp_path_factory.mktemp("zebra") / "adapter")
    model.save_pretrained(path)
    return path


@pytest.mark.slow  # CI time: run by hand (pytest -m slow)
def test_pattern_through_llm(smollm2_path: str, adapter_dir: str) -> None:
    llm = LLM(smollm2_path, enable_lora=True, max_lora_rank=8, **ENGINE)
    lora = LoRARequest("zebra", 1, adapter_dir)
    with_adapter, base = llm.chat([TEST_CHAT, TEST_CHAT], SP, use_tqdm=False, lora_request=[lora, None])
    assert with_adapter.outputs[0].text.startswith("ZEBRA ZEBRA"), with_adapter.outputs[0].text
    assert "ZEBRA" not in base.outputs[0].text
    out = llm.generate(["The capital of France is"], SP, use_tqdm=False, lora_request=lora)
    assert "ZEBRA" in out[0].outputs[0].text


@pytest.fixture(scope="module")
def server(smollm2_path: str, adapter_dir: str) -> Iterator[ServerProcess]:
    with ServerProcess(
        [
            smollm2_path,
            "--served-model-name",
            "smollm2",
            "--dtype",
            "float32",
            "--gguf-dequantize",
            "--max-model-len",
            "512",
            "--kv-cache-memory-bytes",
            str(64 << 20),
            "--enable-lora",
            "--max-lora-rank",
            "8",
            "--lora-modules",
            f"zebra={adapter_dir}",
            f'{{"name": "zebra2", "path": "{adapter_dir}", "base_model_name": "smollm2"}}',
        ],
        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"},
    ) as srv:
        yield srv


@pytest.mark.slow  # CI time (the adapter's training takes 1.5-4 min on 2 cores): run by hand (pytest -m slow)
def test_pattern_through_openai_client_and_runtime_updates(server: ServerProcess, adapter_dir: str) -> None:
    import httpx

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"smollm2", "zebra", "zebra2"}
    assert cards["zebra"].parent == "smollm2" and cards["zebra"].root == adapter_dir  # type: ignore[attr-defined]

    def chat(model: str) -> str:
        r = client.chat.completions.create(model=model, messages=TEST_CHAT, max_tokens=8, temperature=0.0)  # type: ignore[arg-type]
        return r.choices[0].message.content or ""

    assert chat("zebra").startswith("ZEBRA ZEBRA")
    assert "ZEBRA" not in chat("smollm2")
    comp = client.completions.create(model="zebra2", prompt="The capital of France is", max_tokens=8, temperature=0)
    assert "ZEBRA" in comp.choices[0].text and comp.model == "zebra2"

    # Unload: the name is a 404; unloading it again too; load brings it back.
    r = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "zebra"})
    assert r.status_code == 200 and "removed" in r.text
    with pytest.raises(openai.NotFoundError):
        chat("zebra")
    assert httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "zebra"}).status_code == 404
    assert "zebra" not in {m.id for m in client.models.list().data}
    r = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "zebra", "lora_path": adapter_dir})
    assert r.status_code == 200 and "added" in r.text
    assert chat("zebra").startswith("ZEBRA ZEBRA")

    # Bad loads: 400 with an OpenAI error body, and the server keeps serving.
    bad = [
        {"lora_name": "zebra", "lora_path": adapter_dir},  # already loaded
        {"lora_name": "nowhere", "lora_path": os.path.join(adapter_dir, "missing")},
        {"lora_name": "nopath"},
    ]
    for body in bad:
        r = httpx.post(server.url + "/v1/load_lora_adapter", json=body)
        assert r.status_code == 400, (body, r.status_code, r.text)
        assert r.json()["error"]["code"] == 400
    with pytest.raises(openai.NotFoundError):
        chat("no-such-adapter")
    assert chat("zebra").startswith("ZEBRA ZEBRA")
    metrics = httpx.get(server.url + "/metrics").text
    assert 'pagedllm:lora_requests_info{max_lora="1"' in metrics
