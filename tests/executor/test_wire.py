"""The compact step messages (`executor/wire.py`): what a worker rebuilds equals what the scheduler sent,
and the results the engine core rebuilds equal what the worker produced, over a sequence of steps where
the compact form applies and where it must not."""

from __future__ import annotations

import pickle

from pagedllm.core.scheduler_output import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput
from pagedllm.executor.wire import OutputDecoder, OutputEncoder, SteadyOutput, SteadyStep, StepDecoder, StepEncoder
from pagedllm.sampling_params import SamplingParams


def _decode_step(ids: list[str], computed: list[int], blocks: list | None = None) -> SchedulerOutput:
    n = len(ids)
    c = CachedRequestData(list(ids), [False] * n, blocks or [None] * n, list(computed))
    return SchedulerOutput([], c, dict.fromkeys(ids, 1), n)


def _same(a: SchedulerOutput, b: SchedulerOutput) -> None:
    assert a.num_scheduled_tokens == b.num_scheduled_tokens
    assert list(a.num_scheduled_tokens) == list(b.num_scheduled_tokens)  # the order too (the runner's memo)
    assert a.total_num_scheduled_tokens == b.total_num_scheduled_tokens
    assert a.scheduled_cached_reqs == b.scheduled_cached_reqs
    assert [r.req_id for r in a.scheduled_new_reqs] == [r.req_id for r in b.scheduled_new_reqs]
    assert a.finished_req_ids == b.finished_req_ids and a.preempted_req_ids == b.preempted_req_ids


def test_steps_round_trip() -> None:
    enc, dec = StepEncoder(), StepDecoder()
    new = NewRequestData("c", [1, 2, 3], [], SamplingParams(), ([7],), 0)
    prefill = SchedulerOutput(
        [new], _decode_step(["a", "b"], [5, 6]).scheduled_cached_reqs, {"a": 1, "b": 1, "c": 3}, 5
    )
    steps = [
        _decode_step(["a", "b"], [4, 5]),  # first step: full
        _decode_step(["a", "b"], [5, 6], [None, ([9],)]),  # same requests, one new block: compact
        prefill,  # a new request: full
        _decode_step(["a", "b", "c"], [6, 7, 3]),  # the cached ids changed: full
        _decode_step(["a", "b", "c"], [7, 8, 4]),  # compact
        _decode_step(["a", "b", "c"], [8, 9, 5]),
    ]
    steps[-1].finished_req_ids = {"z"}  # something else to say: full
    kinds = []
    for so in steps:
        wire = pickle.loads(pickle.dumps(enc.encode(so)))
        kinds.append(type(wire))
        _same(so, dec.decode(wire))
    compact = SteadyStep
    assert kinds == [SchedulerOutput, compact, SchedulerOutput, SchedulerOutput, compact, SchedulerOutput]


def test_outputs_round_trip() -> None:
    enc, dec = OutputEncoder(), OutputDecoder()
    outs = [
        ModelRunnerOutput(["a", "b"], [[1], [2]]),  # full
        ModelRunnerOutput(["a", "b"], [[3], [4]]),  # compact
        ModelRunnerOutput(["a", "b"], [[5], []]),  # a partial prefill: full
        ModelRunnerOutput(["a", "b"], [[6], [7]], failed={"b": "boom"}),  # full
        ModelRunnerOutput(["b", "a"], [[8], [9]]),  # another order: full
        ModelRunnerOutput(["b", "a"], [[10], [11]]),  # compact
    ]
    kinds = []
    for out in outs:
        wire = pickle.loads(pickle.dumps(enc.encode(out)))
        kinds.append(type(wire))
        got = dec.decode(wire)
        assert got.req_ids == out.req_ids and got.sampled_token_ids == out.sampled_token_ids
        assert got.failed == out.failed and got.logprobs == out.logprobs
    full = ModelRunnerOutput
    assert kinds == [full, SteadyOutput, full, full, full, SteadyOutput]


def test_mp_executor_steady_messages_end_to_end(tmp_path) -> None:  # noqa: ANN001
    """Greedy decoding without logprobs (compact steps and compact results) through the worker process
    gives the in-process executor's tokens, and the compact forms were really used."""
    from pagedllm import LLM, SamplingParams, TokensPrompt
    from pagedllm.executor import wire
    from tests.executor.parallel_utils import tiny_prompts
    from tests.utils_model import make_tiny_hf_model

    make_tiny_hf_model("llama", tmp_path)
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in tiny_prompts()]
    tokens = {}
    for backend in ("uni", "mp"):
        llm = LLM(str(tmp_path), dtype="float32", skip_tokenizer_init=True, max_model_len=128,
                  kv_cache_memory_bytes=8 << 20, distributed_executor_backend=backend)  # fmt: skip
        encoded: list[type] = []
        decoded: list[type] = []
        if backend == "mp":
            ex = llm.llm_engine.engine_core.engine_core.executor
            _spy(ex._step_encoder, "encode", encoded, result=True)
            _spy(ex._output_decoder, "decode", decoded, result=False)
        try:
            tokens[backend] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]
        finally:
            llm.llm_engine.engine_core.shutdown()
    assert tokens["mp"] == tokens["uni"]  # (encoded / decoded: the mp run's, the last loop)
    assert wire.SteadyStep in encoded and wire.SteadyOutput in decoded


def _spy(obj: object, name: str, log: list[type], result: bool) -> None:
    """Record the type of each call's result (`result`) or argument on `log`."""
    real = getattr(obj, name)

    def spy(arg: object) -> object:
        out = real(arg)
        log.append(type(out if result else arg))
        return out

    setattr(obj, name, spy)
