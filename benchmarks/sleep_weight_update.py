"""On the GPU (acceptance 3): sleep(1) / wake_up on the Llama-3.1-8B shape (dummy bf16 weights): GPU memory
released (torch.cuda.mem_get_info) against the engine's weights + KV cache, sleep and wake-up times, outputs
before and after (bitwise); then sleep(2) -> wake_up -> a full weight update from HF-named CPU tensors
(checkpoint naming, through the weight loaders and the atomic check), its time against the host-to-device
copy floor, and the outputs again.

    PYTHONPATH=. python3 benchmarks/sleep_weight_update.py [--model benchmarks/workloads/llama-3.1-8b] [--out F]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.inputs import TokensPrompt


def hf_state(model: torch.nn.Module, cfg: Any) -> list[tuple[str, torch.Tensor]]:
    """The model's weights as HF-named CPU tensors (fused qkv / gate_up split back), pinned."""
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    out = []
    for name, p in model.named_parameters():
        t = p.detach()
        if ".qkv_proj." in name:
            parts = zip(("q_proj", "k_proj", "v_proj"), t.split([q, kv, kv]))
            out += [(name.replace("qkv_proj", s), x) for s, x in parts]
        elif ".gate_up_proj." in name:
            parts = zip(("gate_proj", "up_proj"), t.chunk(2))
            out += [(name.replace("gate_up_proj", s), x) for s, x in parts]
        else:
            out.append((name, t))
    return [(n, t.to("cpu").contiguous().pin_memory()) for n, t in out]


def h2d_floor(nbytes: int) -> float:
    """Seconds to copy nbytes pinned host -> device (measured on a 1 GiB buffer)."""
    src = torch.empty(1 << 30, dtype=torch.uint8).pin_memory()
    dst = torch.empty_like(src, device="cuda")
    dst.copy_(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    bw = 3 * src.numel() / (time.perf_counter() - t0)
    return nbytes / bw, bw


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="benchmarks/workloads/llama-3.1-8b")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    llm = LLM(
        a.model,
        load_format="dummy",
        dtype="bfloat16",
        max_model_len=4096,
        gpu_memory_utilization=0.85,
        enable_sleep_mode=True,
        skip_tokenizer_init=True,
    )
    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, detokenize=False, logprobs=1)
    prompts = [TokensPrompt(prompt_token_ids=[(7 * i + 13 * j) % 32000 + 10 for j in range(40 + i)]) for i in range(8)]

    def outs() -> list[Any]:
        llm.reset_prefix_cache()
        res = llm.generate(prompts, sp, use_tqdm=False)
        return [
            (o.outputs[0].token_ids, [{t: x.logprob for t, x in s.items()} for s in o.outputs[0].logprobs]) for o in res
        ]

    ref = outs()
    runner = llm.collective_rpc(lambda w: w.model_runner)[0]
    model = runner.model
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_bytes = sum(t.numel() * t.element_size() for t in runner.kv_caches.values())
    torch.cuda.synchronize()
    free0, total = torch.cuda.mem_get_info()
    r: dict[str, Any] = {"device": torch.cuda.get_device_name(), "weights_GiB": weight_bytes / 2**30}
    r["kv_GiB"] = kv_bytes / 2**30
    t0 = time.perf_counter()
    llm.sleep(level=1)
    r["sleep1_s"] = time.perf_counter() - t0
    free1, _ = torch.cuda.mem_get_info()
    r["freed_GiB"] = (free1 - free0) / 2**30
    r["freed_frac_of_weights_kv"] = (free1 - free0) / (weight_bytes + kv_bytes)
    r["used_while_asleep_GiB"] = (total - free1) / 2**30
    t0 = time.perf_counter()
    llm.wake_up()
    r["wake1_s"] = time.perf_counter() - t0
    r["same_after_sleep1"] = outs() == ref
    state = hf_state(model, llm.llm_engine.model_config.hf_config)
    nbytes = sum(t.numel() * t.element_size() for _, t in state)
    llm.sleep(level=2)
    free2, _ = torch.cuda.mem_get_info()
    r["freed_level2_GiB"] = (free2 - free0) / 2**30
    t0 = time.perf_counter()
    llm.wake_up(tags=["weights"])
    r["wake2_weights_s"] = time.perf_counter() - t0

    def apply(worker: Any) -> float:
        from pagedllm.distributed.weight_transfer.apply import apply_weight_update
        from pagedllm.worker.controls import get_controls

        c = get_controls(worker)
        meta = c._meta()
        t = time.perf_counter()
        apply_weight_update(worker.model_runner.model, meta, state)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    r["update_s"] = llm.collective_rpc(apply)[0]
    r["update_GB"] = nbytes / 1e9
    floor_s, bw = h2d_floor(nbytes)
    r["h2d_floor_s"], r["h2d_GBps"] = floor_s, bw / 1e9
    llm.wake_up(tags=["kv_cache"])
    llm.reset_prefix_cache()
    r["same_after_sleep2_update"] = outs() == ref
    print(json.dumps(r, indent=1), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
