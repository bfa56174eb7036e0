"""Acceptance 1: greedy outputs with speculation on equal those with it off, token for token (a
difference only where the comparison policy proves a near-tie), in batches of mixed requests with
chunked prefill forced (a small step budget) and under preemption (a small KV cache):

- n-gram on the real SmolLM2 (float32), reference: the same engine without speculation;
- a draft model on tiny random checkpoints built in the test (the draft shares the target's vocabulary),
  reference: HF transformers' greedy decoding of the target.
"""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm import LLM, SamplingParams, TokensPrompt
from tests.hf_utils import compare_greedy, hf_greedy
from tests.utils_model import VOCAB, make_tiny_hf_model

PASSAGE = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, lit the great lamp, and wrote "
    "the weather in a leather logbook before the ships came round the northern cape."
)
CODE = "def mean(xs):\n    total = 0\n    for x in xs:\n        total += x\n    return total / len(xs)\n"
GROUNDED = [
    f"Repeat the following passage exactly.\n\n{PASSAGE}\n\nRepeated passage:\n",
    f"Here is some code:\n{CODE}\nRewrite it with type hints:\n",
    f"Copy this text word for word: {PASSAGE} Copy:",
]


def _spec_engine(path: str, **kw) -> LLM:  # noqa: ANN003
    return LLM(path, dtype="float32", gguf_dequantize=True, disable_log_stats=True, **kw)


def _totals(llm: LLM):  # noqa: ANN202
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    return sched, sched.spec.totals


@pytest.fixture(scope="module")
def grounded_ids(smollm2_tokenizer, smollm2_prompt_ids) -> list[list[int]]:  # noqa: ANN001
    return [smollm2_tokenizer.encode(p) for p in GROUNDED] + smollm2_prompt_ids[:4]


@pytest.mark.slow  # CI time: run by hand (pytest -m slow)
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_ngram_smollm2_greedy_equals_spec_off(smollm2_path: str, grounded_ids, request, async_scheduling: bool) -> None:  # noqa: ANN001
    torch.set_num_threads(2)
    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in grounded_ids]
    common = {"max_model_len": 256, "max_num_batched_tokens": 32, "num_gpu_blocks_override": 18,
              "schedule_conservativeness": 0.0}  # admit all: the small cache preempts  # fmt: skip
    ref_llm = _spec_engine(smollm2_path, **common)
    refs = [list(o.outputs[0].token_ids) for o in ref_llm.generate(prompts, sp, use_tqdm=False)]
    del ref_llm
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    llm = _spec_engine(smollm2_path, speculative_config=spec, async_scheduling=async_scheduling, **common)
    outs = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]
    sched, tot = _totals(llm)
    assert (llm.llm_engine.engine_core.engine_core.num_steps_ahead > 0) == async_scheduling
    assert sched.num_preemptions > 0, "the small KV cache was meant to force preemption"
    assert tot.num_draft_tokens > 0 and tot.num_accepted_tokens > 0, tot
    for p, o, r in zip(grounded_ids, outs, refs):
        if o != r:  # only a near-tie may explain a difference (the HF model judges it)
            compare_greedy(request.getfixturevalue("smollm2_hf_model"), p, o, r, torch.float32)
    assert outs[:3] == refs[:3]


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):  # noqa: ANN001, ANN201
    """(target dir, target HF model, draft dir: a 1-layer random model, same dir as target = perfect draft)."""
    tdir = tmp_path_factory.mktemp("target")
    ddir = tmp_path_factory.mktemp("draft")
    target = make_tiny_hf_model("llama", tdir, seed=0)
    make_tiny_hf_model("llama", ddir, seed=1, overrides={"num_hidden_layers": 1})
    return str(tdir), target, str(ddir)


def _tiny_prompts() -> list[list[int]]:
    rng = random.Random(3)
    base = [rng.randrange(VOCAB) for _ in range(12)]
    return [[rng.randrange(VOCAB) for _ in range(n)] for n in (5, 23, 40, 9)] + [base * 3]


@pytest.mark.parametrize("draft", ["random_1layer", "target_itself"])
def test_draft_model_greedy_equals_hf(tiny_pair, draft: str) -> None:  # noqa: ANN001
    torch.set_num_threads(2)
    tdir, hf, ddir = tiny_pair
    prompts = _tiny_prompts()
    refs = [hf_greedy(hf, p, 24) for p in prompts]
    llm = LLM(
        tdir,
        dtype="float32",
        skip_tokenizer_init=True,
        max_model_len=128,
        num_gpu_blocks_override=10,
        schedule_conservativeness=0.0,  # admit all: the small cache preempts
        max_num_batched_tokens=16,
        disable_log_stats=True,
        speculative_config={
            "method": "draft_model",
            "model": ddir if draft == "random_1layer" else tdir,
            "num_speculative_tokens": 3,
        },
    )
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    for p, o, r in zip(prompts, outs, refs):
        compare_greedy(hf, p, list(o.outputs[0].token_ids), r, torch.float32)
    sched, tot = _totals(llm)
    assert tot.num_draft_tokens > 0
    if draft == "random_1layer":  # (the perfect draft finishes requests before the cache runs out)
        assert sched.num_preemptions > 0
    if draft == "target_itself":  # a perfect draft: every proposal accepted
        assert tot.num_accepted_tokens == tot.num_draft_tokens, tot


def test_draft_with_another_vocabulary_is_refused(tiny_pair, tmp_path) -> None:  # noqa: ANN001
    tdir, _, _ = tiny_pair
    make_tiny_hf_model("llama", tmp_path, seed=2, overrides={"vocab_size": VOCAB // 2})
    with pytest.raises(ValueError, match="speculative_config.model: the draft's vocabulary"):
        LLM(
            tdir,
            dtype="float32",
            skip_tokenizer_init=True,
            max_model_len=128,
            speculative_config={"method": "draft_model", "model": str(tmp_path), "num_speculative_tokens": 2},
        )


def test_logprobs_and_sampling_with_speculation(tiny_pair) -> None:  # noqa: ANN001
    """Logprobs of emitted tokens (several per step) equal those without speculation, by token id within
    1e-3; random sampling with top-p / top-k runs through the rejection sampler and a seed reproduces."""
    torch.set_num_threads(2)
    tdir, _, _ = tiny_pair
    prompts = [TokensPrompt(prompt_token_ids=p) for p in _tiny_prompts()]
    kw = {"dtype": "float32", "skip_tokenizer_init": True, "max_model_len": 128, "disable_log_stats": True}
    spec = {"method": "draft_model", "model": tdir, "num_speculative_tokens": 3}
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, detokenize=False, logprobs=3)
    plain = LLM(tdir, **kw).generate(prompts, sp, use_tqdm=False)
    llm = LLM(tdir, speculative_config=spec, **kw)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    _, tot = _totals(llm)
    assert tot.num_accepted_tokens > 0
    for a, b in zip(plain, outs):
        assert list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids)
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert set(la) == set(lb)
            for tid in la:
                assert abs(la[tid].logprob - lb[tid].logprob) < 1e-3
                assert la[tid].rank == lb[tid].rank
    rnd = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, max_tokens=16, ignore_eos=True, detokenize=False, seed=7)
    r1 = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, rnd, use_tqdm=False)]
    r2 = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, rnd, use_tqdm=False)]
    assert r1 == r2 and all(len(t) == 16 for t in r1)


def make_eagle_checkpoint(out_dir, with_embed: bool, seed: int = 4) -> None:  # noqa: ANN001
    """A random EAGLE-1 head in the authors' layout: fc (2H -> H, with bias), layers.0.* in HF Llama names
    without the first input norm, optionally embed_tokens; no LM head."""
    import transformers
    from safetensors.torch import save_file

    from tests.utils_model import TINY_COMMON

    cfg = transformers.LlamaConfig(**{**TINY_COMMON, "num_hidden_layers": 1})
    cfg.save_pretrained(str(out_dir))
    g = torch.Generator().manual_seed(seed)
    h, inter, hd = cfg.hidden_size, cfg.intermediate_size, cfg.hidden_size // cfg.num_attention_heads
    kv = cfg.num_key_value_heads * hd

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.2

    w = {
        "fc.weight": rnd(h, 2 * h),
        "fc.bias": rnd(h),
        "layers.0.self_attn.q_proj.weight": rnd(h, h),
        "layers.0.self_attn.k_proj.weight": rnd(kv, h),
        "layers.0.self_attn.v_proj.weight": rnd(kv, h),
        "layers.0.self_attn.o_proj.weight": rnd(h, h),
        "layers.0.mlp.gate_proj.weight": rnd(inter, h),
        "layers.0.mlp.up_proj.weight": rnd(inter, h),
        "layers.0.mlp.down_proj.weight": rnd(h, inter),
        "layers.0.post_attention_layernorm.weight": 1 + rnd(h),
    }
    if with_embed:
        w["embed_tokens.weight"] = rnd(cfg.vocab_size, h)
    save_file(w, str(out_dir / "model.safetensors"))


@pytest.mark.parametrize("with_embed", [False, True], ids=["shared_embedding", "own_embedding"])
def test_eagle_greedy_equals_hf(tiny_pair, tmp_path, with_embed: bool) -> None:  # noqa: ANN001
    torch.set_num_threads(2)
    tdir, hf, _ = tiny_pair
    make_eagle_checkpoint(tmp_path, with_embed)
    prompts = _tiny_prompts()
    refs = [hf_greedy(hf, p, 24) for p in prompts]
    llm = LLM(
        tdir,
        dtype="float32",
        skip_tokenizer_init=True,
        max_model_len=128,
        num_gpu_blocks_override=10,
        schedule_conservativeness=0.0,  # admit all: the small cache preempts
        max_num_batched_tokens=16,
        disable_log_stats=True,
        speculative_config={"method": "eagle", "model": str(tmp_path), "num_speculative_tokens": 3},
    )
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    for p, o, r in zip(prompts, outs, refs):
        compare_greedy(hf, p, list(o.outputs[0].token_ids), r, torch.float32)
    sched, tot = _totals(llm)
    assert tot.num_draft_tokens > 0
    assert sched.num_preemptions > 0


def make_eagle3_checkpoint(out_dir, draft_vocab: int, seed: int = 6) -> None:  # noqa: ANN001
    """A random EAGLE-3 head in the authors' layout: fc (3H -> H), midlayer.* (q/k/v over 2H inputs,
    hidden_norm), norm, lm_head over a reduced draft vocabulary, d2t offsets and the t2d mask."""
    import transformers
    from safetensors.torch import save_file

    from tests.utils_model import TINY_COMMON

    cfg = transformers.LlamaConfig(**{**TINY_COMMON, "num_hidden_layers": 1})
    cfg.draft_vocab_size = draft_vocab
    cfg.save_pretrained(str(out_dir))
    g = torch.Generator().manual_seed(seed)
    h, inter, hd = cfg.hidden_size, cfg.intermediate_size, cfg.hidden_size // cfg.num_attention_heads
    kv = cfg.num_key_value_heads * hd

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.2

    draft_to_target = torch.randperm(VOCAB, generator=g)[:draft_vocab].sort().values
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[draft_to_target] = True
    w = {
        "fc.weight": rnd(h, 3 * h),
        "midlayer.input_layernorm.weight": 1 + rnd(h),
        "midlayer.hidden_norm.weight": 1 + rnd(h),
        "midlayer.self_attn.q_proj.weight": rnd(h, 2 * h),
        "midlayer.self_attn.k_proj.weight": rnd(kv, 2 * h),
        "midlayer.self_attn.v_proj.weight": rnd(kv, 2 * h),
        "midlayer.self_attn.o_proj.weight": rnd(h, h),
        "midlayer.post_attention_layernorm.weight": 1 + rnd(h),
        "midlayer.mlp.gate_proj.weight": rnd(inter, h),
        "midlayer.mlp.up_proj.weight": rnd(inter, h),
        "midlayer.mlp.down_proj.weight": rnd(h, inter),
        "norm.weight": 1 + rnd(h),
        "lm_head.weight": rnd(draft_vocab, h) * 10,
        "d2t": draft_to_target - torch.arange(draft_vocab),
        "t2d": t2d,
    }
    save_file(w, str(out_dir / "model.safetensors"))


def test_eagle3_greedy_equals_hf(tmp_path_factory) -> None:  # noqa: ANN001
    """EAGLE-3 needs three auxiliary target layers (2, L // 2, L - 3): a 4-layer tiny target."""
    torch.set_num_threads(2)
    tdir, hdir = tmp_path_factory.mktemp("t4"), tmp_path_factory.mktemp("eagle3")
    hf = make_tiny_hf_model("llama", tdir, seed=0, overrides={"num_hidden_layers": 4})
    make_eagle3_checkpoint(hdir, draft_vocab=VOCAB // 2)
    prompts = _tiny_prompts()
    refs = [hf_greedy(hf, p, 24) for p in prompts]
    llm = LLM(
        str(tdir),
        dtype="float32",
        skip_tokenizer_init=True,
        max_model_len=128,
        num_gpu_blocks_override=10,
        schedule_conservativeness=0.0,  # admit all: the small cache preempts
        max_num_batched_tokens=16,
        disable_log_stats=True,
        speculative_config={"method": "eagle3", "model": str(hdir), "num_speculative_tokens": 3},
    )
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    for p, o, r in zip(prompts, outs, refs):
        compare_greedy(hf, p, list(o.outputs[0].token_ids), r, torch.float32)
    sched, tot = _totals(llm)
    assert tot.num_draft_tokens > 0
    assert sched.num_preemptions > 0
    head = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.spec.proposer.model.model
    assert int(head.d2t.abs().sum()) > 0  # the draft -> target offsets were loaded
