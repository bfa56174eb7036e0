"""The model runner's start-up warm-up batches (the GPU compiles its attention variants with them) run on
any device, cover every attention launch kind, and leave the KV cache untouched."""

from __future__ import annotations

import torch


def test_dummy_batches_write_nothing(smollm2_llm) -> None:  # noqa: ANN001
    runner = smollm2_llm.llm_engine.engine_core.engine_core.executor.worker.model_runner
    before = {name: kv.clone() for name, kv in runner.kv_caches.items()}
    seen = []
    builder = runner.builders[0]
    orig = builder.build

    def spy(common):  # noqa: ANN001, ANN202
        seen.append((common.num_reqs, common.max_query_len, common.num_computed_tokens_cpu.tolist()))
        return orig(common)

    builder.build = spy
    try:
        runner.run_dummy_batches()
    finally:
        del builder.build
    assert all(torch.equal(before[n], kv) for n, kv in runner.kv_caches.items())
    # A pure prefill, decode + fresh chunk, decode + fresh chunk + chunk with a cached prefix, decode + a
    # 2-token chunk, pure decodes of 1..64 requests.
    assert [s[0] for s in seen] == [1, 2, 3, 2, 1, 2, 4, 8, 16, 32, 64]
    assert seen[2][2] == [16, 0, 16] and seen[3][1] == 2 and all(s[1] == 1 for s in seen[4:])
