"""Multimodal serving cost on the GPU (issue 27, acceptance 4): a Qwen2.5-VL-7B-shaped model
(`benchmarks/workloads/qwen2.5-vl-7b/`: its config and image-processor config; dummy bf16 weights; a
word-level tokenizer with the model's special-token ids built here, so nothing is downloaded) serves
`--num-requests` requests, each one `--image-size` x `--image-size` random image (a different one per
request: no encoder-cache hits) + a short text, `--output-len` greedy tokens each (EOS ignored).

Two passes over fresh images after a warm-up:
- throughput: output tok/s over the engine steps (`LLMEngine.step` wall, the images already processed
  by the HF processor at add time, whose cost is reported apart as `preprocess_s`) and end to end;
- encoder share: the same with the runner timing its encoder calls (synchronized around them, so this
  pass is slightly slower): encoder seconds / step seconds.

Run on the device: `PYTHONPATH=. python benchmarks/mm_bench.py` (`--tiny` shrinks the model for a CPU
smoke run). Prints one JSON line per pass and writes them to `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from typing import Any

import numpy as np

WORKLOAD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workloads", "qwen2.5-vl-7b")
SPECIALS = {
    "<|endoftext|>": 151643,
    "<|im_start|>": 151644,
    "<|im_end|>": 151645,
    "<|vision_start|>": 151652,
    "<|vision_end|>": 151653,
    "<|vision_pad|>": 151654,
    "<|image_pad|>": 151655,
    "<|video_pad|>": 151656,
}
TINY = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4}
TINY_VISION = {"depth": 4, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4, "out_hidden_size": 256}


def build_model_dir(tiny: bool) -> str:
    """A temp model directory: the workload's configs + a tokenizer (words w0..w999 and the specials)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    d = tempfile.mkdtemp(prefix="mm_bench_")
    for name in ("config.json", "preprocessor_config.json"):
        shutil.copy(os.path.join(WORKLOAD, name), d)
    if tiny:
        path = os.path.join(d, "config.json")
        with open(path) as f:
            cfg = json.load(f)
        cfg.update(TINY, num_key_value_heads=2, rope_scaling={"type": "mrope", "mrope_section": [8, 12, 12]})
        cfg["vision_config"].update(TINY_VISION, fullatt_block_indexes=[1, 3])
        with open(path, "w") as f:
            json.dump(cfg, f)
    vocab = {"<unk>": 0, **{f"w{i}": i + 1 for i in range(1000)}, **SPECIALS}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>")
    fast.add_special_tokens({"additional_special_tokens": [t for t in SPECIALS if t != "<|im_end|>"]})
    fast.save_pretrained(d)
    return d


def make_prompts(n: int, size: int, seed: int) -> list[dict[str, Any]]:
    from PIL import Image

    rng = np.random.RandomState(seed)
    out = []
    for i in range(n):
        img = Image.fromarray(rng.randint(0, 256, (size, size, 3), dtype=np.uint8))
        words = " ".join(f"w{j}" for j in rng.randint(0, 1000, 24))
        text = f"<|im_start|>user <|vision_start|><|image_pad|><|vision_end|> {words} <|im_end|> <|im_start|>assistant"
        out.append({"prompt": text, "multi_modal_data": {"image": img}, "_i": i})
    return out


def run_pass(llm: Any, prompts: list[dict[str, Any]], output_len: int, time_encoder: bool) -> dict[str, Any]:
    from pagedllm import SamplingParams

    engine = llm.llm_engine
    runner = engine.engine_core.engine_core.executor.worker.model_runner
    runner.mm.time_encoder = time_encoder
    runner.mm.encoder_seconds = 0.0
    enc = engine.engine_core.engine_core.scheduler.encoder
    encoded0 = enc.encoded if enc is not None else 0
    sp = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, detokenize=False)
    tag = str(time.monotonic())
    t0 = time.perf_counter()
    for p in prompts:
        engine.add_request(f"{tag}-{p['_i']}", {k: v for k, v in p.items() if k != "_i"}, sp)
    preprocess = time.perf_counter() - t0
    n_out = steps = 0
    t1 = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                n_out += len(out.outputs[0].token_ids)
        steps += 1
    step_s = time.perf_counter() - t1
    rec = {
        "requests": len(prompts),
        "output_tokens": n_out,
        "steps": steps,
        "preprocess_s": round(preprocess, 3),
        "step_s": round(step_s, 3),
        "output_tok_s": round(n_out / step_s, 1),
        "output_tok_s_end_to_end": round(n_out / (step_s + preprocess), 1),
        "images_encoded": (engine.engine_core.engine_core.scheduler.encoder.encoded - encoded0),
    }
    if time_encoder:
        rec["encoder_s"] = round(runner.mm.encoder_seconds, 3)
        rec["encoder_share_of_step_time"] = round(runner.mm.encoder_seconds / step_s, 4)
    return rec


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--image-size", type=int, default=448)
    p.add_argument("--warmup", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="auto")
    p.add_argument("--tiny", action="store_true", help="a small model of the same structure (CPU smoke run)")
    p.add_argument("--out", default="mm_bench.json")
    args = p.parse_args()

    from pagedllm import LLM

    model_dir = build_model_dir(args.tiny)
    t0 = time.perf_counter()
    kw: dict[str, Any] = {}
    if args.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    llm = LLM(
        model_dir,
        load_format="dummy",
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        gpu_memory_utilization=args.gpu_memory_utilization,
        limit_mm_per_prompt={"image": 1},
        **kw,
    )
    startup = time.perf_counter() - t0
    results = []
    run_pass(llm, make_prompts(args.warmup, args.image_size, seed=999), min(args.output_len, 16), False)
    for name, seed, timed in (("throughput", 1, False), ("encoder_share", 2, True)):
        rec = {"pass": name, "startup_s": round(startup, 1), "image_size": args.image_size, "tiny": args.tiny}
        rec.update(run_pass(llm, make_prompts(args.num_requests, args.image_size, seed), args.output_len, timed))
        print(json.dumps(rec), flush=True)
        results.append(rec)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    shutil.rmtree(model_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
