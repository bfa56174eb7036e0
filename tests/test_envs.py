"""pagedllm/envs.py: process-wide defaults pagedllm sets."""

from __future__ import annotations


def test_openmp_threads_spin_briefly_unless_the_user_says_otherwise() -> None:
    """`import pagedllm` sets GOMP_SPINCOUNT=2000 before torch loads OpenMP (waiting threads spin briefly, then
    sleep: libgomp's long spin made a busy neighbour 10x slower, sleeping at once cost ~2x on a quiet machine;
    NOTES "OpenMP barriers, session 13"); a policy or spin count the user set is kept, and no count is added
    to a user's OMP_WAIT_POLICY."""
    import os
    import subprocess
    import sys

    code = "import os, pagedllm, torch; print(os.environ.get('GOMP_SPINCOUNT'), os.environ.get('OMP_WAIT_POLICY'))"
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}

    def run(**extra: str) -> str:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**env, **extra},
                             timeout=120)  # fmt: skip
        return out.stdout.strip()

    assert run() == "2000 None"
    assert run(GOMP_SPINCOUNT="50") == "50 None"
    assert run(OMP_WAIT_POLICY="PASSIVE") == "None PASSIVE"
