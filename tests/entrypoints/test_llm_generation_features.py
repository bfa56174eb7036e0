"""Acceptance 5: stop strings across token boundaries, multi-byte UTF-8 streaming, min_tokens,
ignore_eos, max_tokens and n=4 (prompt prefilled once), on the real SmolLM2 model."""

from __future__ import annotations

import torch

from pagedllm import LLM, RequestOutputKind, SamplingParams
from pagedllm.sample.logits_processor import LogitsProcessor
from pagedllm.sample.metadata import SamplingMetadata

GREEDY = dict(temperature=0.0)


def test_stop_string_spanning_tokens(smollm2_llm: LLM, smollm2_tokenizer) -> None:  # noqa: ANN001
    prompt = "The capital of France is"
    base = smollm2_llm.generate([prompt], SamplingParams(max_tokens=30, ignore_eos=True, **GREEDY), use_tqdm=False)[
        0
    ].outputs[0]
    tok = smollm2_tokenizer
    # A stop string made of the end of one token and the start of the next.
    pieces = [tok.decode([t]) for t in base.token_ids]
    i = next(i for i in range(3, len(pieces) - 1) if len(pieces[i].strip()) >= 2 and len(pieces[i + 1].strip()) >= 2)
    prefix = "".join(pieces[:i])
    stop = pieces[i][-2:] + pieces[i + 1][:2]
    assert stop in base.text
    cut = base.text.index(stop)
    assert cut >= len(prefix) - 2  # the stop string straddles the token boundary
    out = smollm2_llm.generate([prompt], SamplingParams(max_tokens=30, stop=[stop], **GREEDY), use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.text == base.text[:cut]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    out2 = smollm2_llm.generate(
        [prompt], SamplingParams(max_tokens=30, stop=[stop], include_stop_str_in_output=True, **GREEDY), use_tqdm=False
    )[0]
    assert out2.outputs[0].text == base.text[:cut] + stop


def test_max_tokens_ignore_eos_min_tokens(smollm2_llm: LLM, smollm2_tokenizer) -> None:  # noqa: ANN001
    conv = [{"role": "user", "content": "What is the capital of France?"}]
    short = smollm2_llm.chat(conv, SamplingParams(max_tokens=200, **GREEDY), use_tqdm=False)[0].outputs[0]
    eos = smollm2_tokenizer.eos_token_id
    assert short.finish_reason == "stop" and short.token_ids[-1] == eos and len(short.token_ids) < 30
    # min_tokens: EOS is masked until 30 tokens exist.
    longer = smollm2_llm.chat(conv, SamplingParams(max_tokens=200, min_tokens=30, **GREEDY), use_tqdm=False)[0]
    ids = longer.outputs[0].token_ids
    assert len(ids) >= 30 and eos not in ids[:29]
    # ignore_eos: runs to max_tokens.
    ign = smollm2_llm.chat(conv, SamplingParams(max_tokens=40, ignore_eos=True, **GREEDY), use_tqdm=False)[0]
    assert len(ign.outputs[0].token_ids) == 40 and ign.outputs[0].finish_reason == "length"
    assert eos in ign.outputs[0].token_ids  # it did produce EOS and went on
    five = smollm2_llm.generate(["Once upon a time"], SamplingParams(max_tokens=5, **GREEDY), use_tqdm=False)[0]
    assert len(five.outputs[0].token_ids) == 5 and five.outputs[0].finish_reason == "length"


def test_n4_prefills_prompt_once(smollm2_llm: LLM) -> None:
    sched = smollm2_llm.llm_engine.engine_core.engine_core.scheduler
    prompt = "Write a story about a dragon who learns to paint. " * 6  # several full blocks
    n_prompt = len(smollm2_llm.get_tokenizer().encode(prompt))
    hits0 = sched.kv.prefix_cache_hits
    out = smollm2_llm.generate([prompt], SamplingParams(n=4, temperature=0.8, seed=7, max_tokens=16), use_tqdm=False)
    assert len(out) == 1 and len(out[0].outputs) == 4
    assert [o.index for o in out[0].outputs] == [0, 1, 2, 3]
    full_blocks = (n_prompt - 1) // 16 * 16
    # Children 1..3 reuse the first child's prompt blocks (registered when scheduled, same step).
    assert sched.kv.prefix_cache_hits - hits0 >= 3 * full_blocks
    assert len({tuple(o.token_ids) for o in out[0].outputs}) > 1


class ForceTokens(LogitsProcessor):
    """Forces a fixed output token sequence (to stream known multi-byte text through the engine)."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def apply(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        for row, out in enumerate(metadata.output_token_ids):
            if len(out) < len(self.ids):
                forced = self.ids[len(out)]
                logits[row] = -float("inf")
                logits[row, forced] = 0.0
        return logits


def test_multibyte_streaming(smollm2_path: str, smollm2_tokenizer) -> None:  # noqa: ANN001
    text = " 猫が好き 🐱🎉 café — naïve 你好世界"
    ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
    llm = LLM(
        smollm2_path,
        dtype="float32",
        max_model_len=256,
        kv_cache_memory_bytes=32 << 20,
        logits_processors=[ForceTokens(ids)],
    )
    engine = llm.llm_engine
    engine.add_request(
        "mb", "Say something:", SamplingParams(max_tokens=len(ids), output_kind=RequestOutputKind.DELTA, **GREEDY)
    )
    deltas: list[str] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append(out.outputs[0].text)
    assert all("\ufffd" not in d for d in deltas), deltas
    assert "".join(deltas) == smollm2_tokenizer.decode(ids) == text
    assert sum(1 for d in deltas if d == "") > 0  # some steps held back an incomplete character
