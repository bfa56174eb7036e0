"""OutputProcessor driven by hand-made core outputs; ParentRequest; RequestOutputCollector."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from pagedllm.engine.output_collector import RequestOutputCollector
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.parallel_sampling import ParentRequest
from pagedllm.messages import EngineCoreOutput, EngineCoreRequest, FinishReason
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

PROMPT = "<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n"
ANSWER = "Hello there, friend! 👋 你好"


def _req(tok: Any, request_id: str = "r", **kw: Any) -> EngineCoreRequest:
    kw.setdefault("max_tokens", None)
    return EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=tok.encode(PROMPT),
        sampling_params=SamplingParams(**kw),
        arrival_time=time.monotonic(),
    )


def _out(rid: str, ids: list[int], finish: FinishReason | None = None, **kw: Any) -> EngineCoreOutput:
    return EngineCoreOutput(request_id=rid, new_token_ids=ids, finish_reason=finish, **kw)


def _drive(op: OutputProcessor, rid: str, ids: list[int], last: FinishReason) -> list[RequestOutput]:
    outs: list[RequestOutput] = []
    for i, t in enumerate(ids):
        res = op.process_outputs([_out(rid, [t], last if i == len(ids) - 1 else None)])
        outs.extend(res.request_outputs)
    return outs


@pytest.fixture
def op(smollm2_tokenizer: Any) -> OutputProcessor:
    return OutputProcessor(smollm2_tokenizer)


def test_cumulative(op: OutputProcessor, smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    ids = tok.encode(ANSWER)
    op.add_request(_req(tok), PROMPT)
    outs = _drive(op, "r", ids, FinishReason.LENGTH)
    assert len(outs) == len(ids)
    for i, o in enumerate(outs):
        assert o.request_id == "r" and o.prompt == PROMPT
        assert o.outputs[0].token_ids == ids[: i + 1]
        assert ANSWER.startswith(o.outputs[0].text)
        assert "\ufffd" not in o.outputs[0].text
    final = outs[-1]
    assert final.finished and final.outputs[0].text == ANSWER
    assert final.outputs[0].finish_reason == "length" and final.outputs[0].stop_reason is None
    assert not any(o.finished for o in outs[:-1])
    assert not op.has_unfinished_requests()


def test_delta(op: OutputProcessor, smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    ids = tok.encode(ANSWER)
    op.add_request(_req(tok, output_kind=RequestOutputKind.DELTA), PROMPT)
    outs = _drive(op, "r", ids, FinishReason.LENGTH)
    assert "".join(o.outputs[0].text for o in outs) == ANSWER
    assert [t for o in outs for t in o.outputs[0].token_ids] == ids
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"


def test_final_only(op: OutputProcessor, smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    ids = tok.encode(ANSWER) + [tok.eos_token_id]
    op.add_request(_req(tok, output_kind=RequestOutputKind.FINAL_ONLY), PROMPT)
    outs = _drive(op, "r", ids, FinishReason.STOP)
    assert len(outs) == 1
    comp = outs[0].outputs[0]
    assert outs[0].finished and comp.text == ANSWER and comp.token_ids == ids
    assert comp.finish_reason == "stop" and comp.stop_reason is None


def test_stop_token_id_reason_and_metrics(op: OutputProcessor, smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    ids = tok.encode("One. Two.")
    req = _req(tok, stop_token_ids=[ids[-1]])
    op.add_request(req, PROMPT)
    res = op.process_outputs([_out("r", ids[:2], num_cached_tokens=4)])
    assert res.iteration_stats is not None
    assert res.iteration_stats.num_prompt_tokens == len(req.prompt_token_ids)
    assert len(res.iteration_stats.ttfts) == 1 and res.iteration_stats.num_generation_tokens == 2
    res = op.process_outputs([_out("r", ids[2:], FinishReason.STOP, stop_reason=ids[-1])])
    (o,) = res.request_outputs
    comp = o.outputs[0]
    assert comp.finish_reason == "stop" and comp.stop_reason == ids[-1]
    assert comp.text == tok.decode(ids[:-1]) and comp.token_ids == ids
    assert o.num_cached_tokens == 4
    m = o.metrics
    assert m is not None and m.arrival_time == req.arrival_time
    assert m.first_token_time is not None and m.finished_time is not None
    assert m.arrival_time <= m.first_token_time <= m.last_token_time <= m.finished_time  # type: ignore[operator]
    assert m.num_generation_tokens == len(ids)
    stats = res.iteration_stats
    assert stats is not None and len(stats.itls) == 1
    (fin,) = stats.finished_requests
    assert fin.finish_reason == "stop" and fin.num_generation_tokens == len(ids) and fin.num_cached_tokens == 4


def test_stop_string_aborts_in_core(op: OutputProcessor, smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    ids = tok.encode("First line.\nSecond line.")
    op.add_request(_req(tok, stop=["\n"], output_kind=RequestOutputKind.DELTA), PROMPT)
    streamed = ""
    aborted: list[str] = []
    finals = []
    for t in ids:
        res = op.process_outputs([_out("r", [t])])
        aborted += res.reqs_to_abort
        for o in res.request_outputs:
            streamed += o.outputs[0].text
            if o.finished:
                finals.append(o)
        if finals:
            break
    assert aborted == ["r"]
    (final,) = finals
    assert final.outputs[0].finish_reason == "stop" and final.outputs[0].stop_reason == "\n"
    assert streamed == "First line."
    assert not op.has_unfinished_requests()
    # late outputs of the aborted request are ignored
    assert op.process_outputs([_out("r", [ids[-1]])]).request_outputs == []


def test_stop_string_when_core_already_finished(op: OutputProcessor, smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    ids = tok.encode("abc END")
    op.add_request(_req(tok, stop=["END"]), PROMPT)
    res = op.process_outputs([_out("r", ids, FinishReason.LENGTH)])
    assert res.reqs_to_abort == []  # the core has finished it already
    comp = res.request_outputs[0].outputs[0]
    assert comp.text == "abc " and comp.finish_reason == "stop" and comp.stop_reason == "END"


def test_duplicate_request_id(op: OutputProcessor, smollm2_tokenizer: Any) -> None:
    op.add_request(_req(smollm2_tokenizer), None)
    with pytest.raises(ValueError, match="request_id"):
        op.add_request(_req(smollm2_tokenizer), None)


def test_parent_request_child_info() -> None:
    parent = ParentRequest("p", SamplingParams(n=3, seed=10))
    infos = [parent.get_child_info(i) for i in range(3)]
    assert [cid for cid, _ in infos] == ["0_p", "1_p", "2_p"]
    assert [sp.n for _, sp in infos] == [1, 1, 1]
    assert [sp.seed for _, sp in infos] == [10, 11, 12]
    no_seed = ParentRequest("q", SamplingParams(n=2))
    assert no_seed.get_child_info(1)[1].seed is None


def _add_parent(op: OutputProcessor, tok: Any, kind: RequestOutputKind, queue: Any = None) -> ParentRequest:
    parent = ParentRequest("p", SamplingParams(n=3, max_tokens=None, output_kind=kind))
    for i in range(3):
        cid, sp = parent.get_child_info(i)
        req = EngineCoreRequest(cid, tok.encode(PROMPT), sp, time.monotonic())
        op.add_request(req, PROMPT, parent, i, queue)
    return parent


CHILD_TEXTS = ["Red apples.", "Green pears and plums.", "Blue."]


def _run_children(op: OutputProcessor, tok: Any) -> list[list[RequestOutput]]:
    """Each child gets one token per step and finishes on length at its last token."""
    child_ids = [tok.encode(t) for t in CHILD_TEXTS]
    steps: list[list[RequestOutput]] = []
    for step in range(max(map(len, child_ids))):
        batch = []
        for i, ids in enumerate(child_ids):
            if step < len(ids):
                fin = FinishReason.LENGTH if step == len(ids) - 1 else None
                batch.append(_out(f"{i}_p", [ids[step]], fin))
        steps.append(op.process_outputs(batch).request_outputs)
    return steps


def test_parallel_sampling_cumulative(op: OutputProcessor, smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    _add_parent(op, tok, RequestOutputKind.CUMULATIVE)
    assert op.get_num_unfinished_requests() == 3
    steps = _run_children(op, tok)
    for step_outs in steps:
        (o,) = step_outs  # one aggregated output per step
        assert o.request_id == "p"
        assert [c.index for c in o.outputs] == [0, 1, 2]
    final = steps[-1][0]
    assert final.finished and not any(s[0].finished for s in steps[:-1])
    assert [c.text for c in final.outputs] == CHILD_TEXTS
    assert all(c.finish_reason == "length" for c in final.outputs)
    assert final.metrics is not None
    assert final.metrics.num_generation_tokens == sum(len(tok.encode(t)) for t in CHILD_TEXTS)
    assert not op.has_unfinished_requests() and not op.parent_requests


def test_parallel_sampling_final_only(op: OutputProcessor, smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    _add_parent(op, tok, RequestOutputKind.FINAL_ONLY)
    steps = _run_children(op, tok)
    flat = [o for s in steps for o in s]
    assert len(flat) == 1 and flat[0].finished
    assert [c.text for c in flat[0].outputs] == CHILD_TEXTS
    assert [c.index for c in flat[0].outputs] == [0, 1, 2]


def test_parallel_sampling_delta(op: OutputProcessor, smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    _add_parent(op, tok, RequestOutputKind.DELTA)
    steps = _run_children(op, tok)
    texts = ["", "", ""]
    n_tokens = [len(tok.encode(t)) for t in CHILD_TEXTS]
    for step, step_outs in enumerate(steps):
        (o,) = step_outs
        # only the children that produced a token in this step
        assert [c.index for c in o.outputs] == [i for i in range(3) if step < n_tokens[i]]
        for c in o.outputs:
            texts[c.index] += c.text
    assert texts == CHILD_TEXTS
    assert steps[-1][0].finished


def test_abort_parent_and_single(op: OutputProcessor, smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    _add_parent(op, tok, RequestOutputKind.CUMULATIVE)
    op.add_request(_req(tok, "solo"), PROMPT)
    op.process_outputs([_out("0_p", [10], FinishReason.LENGTH), _out("1_p", [11])])
    assert op.get_num_unfinished_requests() == 3
    assert sorted(op.abort_requests(["p", "missing"])) == ["1_p", "2_p"]
    assert op.get_num_unfinished_requests() == 1 and not op.parent_requests
    assert op.abort_requests(["solo"]) == ["solo"]
    assert not op.has_unfinished_requests()
    assert op.process_outputs([_out("solo", [1]), _out("1_p", [1])]).request_outputs == []


def test_queue_routing_and_abort_output(op: OutputProcessor, smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    q = RequestOutputCollector(RequestOutputKind.DELTA)
    op.add_request(_req(tok, output_kind=RequestOutputKind.DELTA), PROMPT, queue=q)
    ids = tok.encode("Hi there")
    for t in ids:  # nobody reads: the deltas merge
        assert op.process_outputs([_out("r", [t])]).request_outputs == []
    got = q.get_nowait()
    assert got is not None and got.outputs[0].text == "Hi there" and got.outputs[0].token_ids == ids
    assert q.get_nowait() is None
    assert op.abort_requests(["r"]) == ["r"]
    last = q.get_nowait()
    assert last is not None and last.finished and last.outputs[0].finish_reason == "abort"


def test_parent_queue_gets_aggregated_outputs(op: OutputProcessor, smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    q = RequestOutputCollector(RequestOutputKind.FINAL_ONLY)
    _add_parent(op, tok, RequestOutputKind.FINAL_ONLY, q)
    steps = _run_children(op, tok)
    assert all(s == [] for s in steps)
    got = q.get_nowait()
    assert got is not None and got.request_id == "p" and [c.text for c in got.outputs] == CHILD_TEXTS


def _ro(text: str, ids: list[int], finished: bool = False, index: int = 0) -> RequestOutput:
    comp = CompletionOutput(index=index, text=text, token_ids=ids, finish_reason="stop" if finished else None)
    return RequestOutput("r", None, [1], [comp], finished)


def test_collector_merge_replace_and_error() -> None:
    q = RequestOutputCollector(RequestOutputKind.DELTA)
    q.put(_ro("a", [1]))
    q.put(_ro("b", [2]))
    q.put(_ro("c", [3], finished=True))
    got = q.get_nowait()
    assert got is not None and got.outputs[0].text == "abc" and got.outputs[0].token_ids == [1, 2, 3]
    assert got.finished and got.outputs[0].finish_reason == "stop"

    q = RequestOutputCollector(RequestOutputKind.CUMULATIVE)
    q.put(_ro("a", [1]))
    q.put(_ro("ab", [1, 2]))
    got = q.get_nowait()
    assert got is not None and got.outputs[0].text == "ab"

    q = RequestOutputCollector(RequestOutputKind.DELTA)
    q.put(_ro("a", [1]))
    q.put(RuntimeError("engine died"))
    with pytest.raises(RuntimeError, match="engine died"):
        q.get_nowait()


def test_collector_async_get() -> None:
    async def main() -> list[str]:
        q = RequestOutputCollector(RequestOutputKind.DELTA)
        texts: list[str] = []

        async def reader() -> None:
            while True:
                out = await q.get()
                texts.append(out.outputs[0].text)
                if out.finished:
                    return

        task = asyncio.create_task(reader())
        await asyncio.sleep(0)
        q.put(_ro("x", [1]))
        await asyncio.sleep(0)
        q.put(_ro("y", [2]))
        q.put(_ro("z", [3], finished=True))
        await asyncio.wait_for(task, 2)
        return texts

    texts = asyncio.run(main())
    assert "".join(texts) == "xyz"
    assert texts[0] == "x"
