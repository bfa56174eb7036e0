"""Speculative decoding on the GPU (Triton attention: several query tokens per request against the paged
KV cache; plain decode steps replay the decode CUDA graphs, verification steps the graphs of k + 1 rows per
request, padded where a request has fewer proposals; n-gram also with async scheduling, the graph's inputs then
fixed up on the device): greedy outputs with n-gram and draft-model speculation
equal HF transformers' by the numerical-comparison policy, on tiny random float32 checkpoints, with chunked
prefill forced and under preemption; and the same with the engine eager."""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from pagedllm import LLM, SamplingParams, TokensPrompt  # noqa: E402
from tests.hf_utils import compare_greedy, hf_greedy  # noqa: E402
from tests.utils_model import VOCAB, make_tiny_hf_model  # noqa: E402


def _target_and_spec(method: str, tmp_path) -> tuple:  # noqa: ANN001
    """(the tiny float32 target's directory, its HF model on the GPU, the speculative config: n-gram, or a
    one-layer draft sharing its vocabulary)."""
    tdir, ddir = tmp_path / "t", tmp_path / "d"
    hf = make_tiny_hf_model("llama", tdir, seed=0).to("cuda")
    if method == "ngram":
        ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
        return tdir, hf, ngram
    make_tiny_hf_model("llama", ddir, seed=1, overrides={"num_hidden_layers": 1})
    return tdir, hf, {"method": "draft_model", "model": str(ddir), "num_speculative_tokens": 3}


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize(
    "method,async_scheduling",
    [("ngram", True), ("ngram", False), ("draft_model", False)],
    ids=["ngram_async", "ngram_sync", "draft_model"],
)
def test_spec_decode_greedy_matches_hf_gpu(method: str, async_scheduling: bool, eager: bool, tmp_path) -> None:  # noqa: ANN001
    tdir, hf, spec = _target_and_spec(method, tmp_path)
    rng = random.Random(5)
    base = [rng.randrange(VOCAB) for _ in range(10)]
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (4, 21, 37, 9)] + [base * 3, base * 2 + [1, 2]]
    refs = [hf_greedy(hf, p, 24) for p in prompts]
    llm = LLM(
        str(tdir),
        dtype="float32",
        skip_tokenizer_init=True,
        max_model_len=128,
        num_gpu_blocks_override=10,
        schedule_conservativeness=0.0,  # admit all: the small cache preempts
        max_num_batched_tokens=16,
        speculative_config=spec,
        enforce_eager=eager,
        async_scheduling=async_scheduling,
    )
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    for p, o, r in zip(prompts, outs, refs):
        compare_greedy(hf, p, list(o.outputs[0].token_ids), r, torch.float32)
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    assert sched.spec.totals.num_draft_tokens > 0 and sched.spec.totals.num_accepted_tokens > 0
    assert sched.num_preemptions > 0
    assert (llm.llm_engine.engine_core.engine_core.num_steps_ahead > 0) == async_scheduling
    runner = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner
    if eager:
        assert runner.verify_graphs is None
    else:  # verification steps replayed the k + 1-row graphs
        assert runner.verify_graphs is not None
        steps = runner.spec.async_steps
        if async_scheduling:  # the plain greedy steps' path: the fused graphs
            assert steps.num_fast_steps > 0 and steps.fused is not None and steps.fused.num_runs > 0
        else:
            assert runner.verify_graphs.num_padded_runs > 0
        if method == "draft_model":  # the draft's catch-up and one-token forwards replayed its own graphs
            draft = runner.spec.proposer
            assert draft.graphs is not None and draft.catchup_graphs.num_padded_runs > 0


@pytest.mark.parametrize(
    "method,async_scheduling",
    [("ngram", True), ("ngram", False), ("draft_model", False)],
    ids=["ngram_async", "ngram_sync", "draft_model"],
)
def test_spec_decode_prefill_graphs_gpu(method: str, async_scheduling: bool, tmp_path) -> None:  # noqa: ANN001
    """With room for whole prompts in a step, n-gram and draft-model speculation run their prefill and mixed
    steps through the whole-step graphs (EAGLE does not: its hooks read the target's intermediate layers), and
    the greedy outputs still equal HF's."""
    tdir, hf, spec = _target_and_spec(method, tmp_path)
    rng = random.Random(7)
    base = [rng.randrange(VOCAB) for _ in range(12)]
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (5, 40, 17)] + [base * 3, base * 2 + [3]]
    refs = [hf_greedy(hf, p, 24) for p in prompts]
    llm = LLM(
        str(tdir), dtype="float32", skip_tokenizer_init=True, max_model_len=128, max_num_batched_tokens=256,
        speculative_config=spec, async_scheduling=async_scheduling,
    )  # fmt: skip
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, detokenize=False)
    # one request first (its prefill alone), then the rest together (prefills beside decodes)
    outs = llm.generate([TokensPrompt(prompt_token_ids=prompts[0])], sp, use_tqdm=False)
    outs += llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts[1:]], sp, use_tqdm=False)
    for p, o, r in zip(prompts, outs, refs):
        compare_greedy(hf, p, list(o.outputs[0].token_ids), r, torch.float32)
    runner = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner
    graphs = runner.mixed_graphs or runner.piecewise
    assert graphs is not None and graphs.num_runs > 0
