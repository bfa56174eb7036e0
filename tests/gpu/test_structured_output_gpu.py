"""Structured outputs on the GPU: xgrammar's CUDA/Triton apply on bf16 and float32 logits equals the CPU
kernel's, and the real SmolLM2 (float32, CUDA graphs, async scheduling on: step N+1's bitmask fill waits for
step N's tokens) gives valid JSON whose greedy tokens equal a synchronous engine's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("xgrammar")

from pagedllm import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from pagedllm.core.scheduler_output import CachedRequestData, SchedulerOutput  # noqa: E402
from pagedllm.structured_output.apply import apply_grammar_bitmask  # noqa: E402
from tests.structured_output.cases import SCHEMAS, check_json, prompts  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_matches_cpu(dtype: torch.dtype) -> None:
    rng = np.random.default_rng(0)
    n, vocab = 8, 49152
    mask = rng.integers(-(2**31), 2**31 - 1, size=(5, (vocab + 31) // 32), dtype=np.int64).astype(np.int32)
    ids = {f"r{i}": j for j, i in enumerate([0, 2, 3, 6, 7])}
    so = SchedulerOutput([], CachedRequestData(), {}, 0, structured_output_request_ids=ids, grammar_bitmask=mask)
    logits = torch.randn(n, vocab, dtype=dtype)
    gpu = logits.cuda()
    rids = [f"r{i}" for i in range(n)]
    apply_grammar_bitmask(logits, so, rids, np.arange(n))
    apply_grammar_bitmask(gpu, so, rids, np.arange(n))
    assert torch.equal(gpu.cpu(), logits)
    assert torch.isinf(logits[0]).any() and not torch.isinf(logits[1]).any()


class _Source:
    """A filled step mask as `GrammarBitmask.narrow()` gives it: the tokenizer's ids only, and the rows still
    constrained (the others' grammars terminated: all bits set, left alone)."""

    def __init__(self, mask: torch.Tensor, rows: list[int], valid_vocab: int) -> None:
        self.mask, self.rows, self.valid_vocab = mask, rows, valid_vocab
        self.logit_rows: list[int | None] | None = None
        self.uploads = 0

    def uploaded(self) -> None:
        self.uploads += 1

    def narrow(self) -> tuple[torch.Tensor, list[int]]:
        return self.mask, self.rows


@pytest.mark.parametrize("order", ["in_order", "mapped"])
def test_apply_padded_vocab_and_terminated_rows(order: str) -> None:
    """The one-launch CUDA apply against a reference built here: tokenizer ids by the mask's bits, the model's
    padded ids (past the tokenizer's) -inf in constrained rows only; rows without a grammar or whose grammar
    terminated untouched."""
    rng = np.random.default_rng(1)
    n, valid, vocab = 6, 1000, 1100  # a partial last word (1000 % 32 = 8) and 100 padded ids
    words = (valid + 31) // 32
    mask = torch.from_numpy(rng.integers(-(2**31), 2**31 - 1, size=(4, words), dtype=np.int64).astype(np.int32))
    if order == "in_order":  # logits rows 0..3 are mask rows 0..3, all constrained (+ 2 free rows)
        rows, ids = [0, 1, 2, 3], {f"r{i}": i for i in range(4)}
    else:  # mask rows in another order, among free rows; row 2's grammar terminated (all allowed, not in `rows`)
        mask[2] = -1
        rows, ids = [0, 1, 3], {"r5": 0, "r1": 1, "r3": 2, "r0": 3}
    so = SchedulerOutput(
        [], CachedRequestData(), {}, 0, structured_output_request_ids=ids, grammar_bitmask=_Source(mask, rows, valid)
    )
    rids = [f"r{i}" for i in range(n)]
    logits = torch.randn(n, vocab)
    ref = logits.clone()
    bits = ((mask.numpy()[:, :, None] >> np.arange(32)) & 1).reshape(4, -1)[:, :valid] == 1
    for j, rid in enumerate(rids):
        r = ids.get(rid)
        if r is None or r not in rows:
            continue
        ref[j, :valid][torch.from_numpy(~bits[r])] = float("-inf")
        ref[j, valid:] = float("-inf")
    for _ in range(3):  # the first launch compiles; the later ones go through the compiled kernel's launcher
        gpu = logits.cuda()
        apply_grammar_bitmask(gpu, so, rids, np.arange(n))
        assert torch.equal(gpu.cpu(), ref)
    assert so.grammar_bitmask.logit_rows == [ids.get(r) for r in rids]
    assert so.grammar_bitmask.uploads == 3


def test_async_engine_valid_and_equal_to_sync(smollm2_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDLLM_GRAMMAR_PROCESS", "0")  # the worker thread's path (the deferred sampling)
    sps = [
        SamplingParams(
            temperature=0.0,
            max_tokens=200,
            structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True),
        )
        for schema in SCHEMAS.values()
    ]
    ps = prompts(5)
    outs = {}
    for async_on in (True, False):
        llm = LLM(
            smollm2_path,
            dtype="float32",
            max_model_len=1024,
            kv_cache_memory_bytes=1 << 30,
            gguf_dequantize=True,
            async_scheduling=async_on,
        )
        outs[async_on] = llm.generate(ps, sps, use_tqdm=False)
        if async_on:
            core = llm.llm_engine.engine_core.engine_core
            assert core.num_steps_ahead > 20
            assert core.executor.worker.model_runner.num_deferred_samplings > 20
        del llm
        torch.cuda.empty_cache()
    for out, schema in zip(outs[True], SCHEMAS.values()):
        check_json(out.outputs[0].text, schema)
    assert [o.outputs[0].token_ids for o in outs[True]] == [o.outputs[0].token_ids for o in outs[False]]


def test_async_deferred_sampling_dummy_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the real checkpoint: SmolLM2's shape with dummy weights and its tokenizer (`.smol_tok`, a
    save_pretrained copy, or PAGEDLLM_SMOL_TOKENIZER), 8 JSON requests. With async scheduling and the grammar
    worker thread (the multiprocess executor's path) each constrained step's sampling is launched after the
    engine read the previous step (deferred), and the greedy tokens equal those of a synchronous engine, whose
    sampling follows the forward directly."""
    import os

    monkeypatch.setenv("PAGEDLLM_GRAMMAR_PROCESS", "0")

    tok = os.environ.get("PAGEDLLM_SMOL_TOKENIZER", ".smol_tok")
    if not os.path.isdir(tok):
        pytest.skip(f"no SmolLM2 tokenizer directory at {tok}")
    schema = SCHEMAS["person"]
    sps = [
        SamplingParams(temperature=0.0, max_tokens=64, structured_outputs=StructuredOutputsParams(json=schema))
    ] * 6 + [SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)] * 2
    ps = [[100 + i, 200 + 3 * i, 300 + 7 * i] for i in range(8)]
    outs = {}
    for async_on in (True, False):
        llm = LLM(
            "benchmarks/workloads/smollm2-135m",
            tokenizer=tok,
            load_format="dummy",
            dtype="float32",
            max_model_len=512,
            kv_cache_memory_bytes=1 << 30,
            async_scheduling=async_on,
        )
        from pagedllm import TokensPrompt

        outs[async_on] = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps], sps, use_tqdm=False)
        if async_on:
            assert llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.num_deferred_samplings > 10
        del llm
        torch.cuda.empty_cache()
    assert [o.outputs[0].token_ids for o in outs[True]] == [o.outputs[0].token_ids for o in outs[False]]
    assert all(len(o.outputs[0].token_ids) > 3 for o in outs[True])


def test_grammar_process_engine_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """The grammar server process on CUDA: the stream waits on the server's flag before the mask's upload and
    writes the sampled ids' flag after their copy (`host_flags.py`); a stale or missing mask would let a token the
    grammar forbids through (`grammar_process_case.py`)."""
    import os

    from tests.structured_output.grammar_process_case import run_engine_case

    tok = os.environ.get("PAGEDLLM_SMOL_TOKENIZER", ".smol_tok")
    if not os.path.isdir(tok):
        pytest.skip(f"no SmolLM2 tokenizer directory at {tok}")
    run_engine_case(monkeypatch, "cuda", tok)
