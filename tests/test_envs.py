"""pagedllm/envs.py: process-wide defaults pagedllm sets."""

from __future__ import annotations


def test_openmp_threads_sleep_at_barriers_unless_the_user_says_otherwise() -> None:
    """`import pagedllm` sets OMP_WAIT_POLICY=PASSIVE before torch loads OpenMP (a busy neighbour made
    spinning threads 10x slower, NOTES "Busy neighbour"); a value the user set is kept."""
    import os
    import subprocess
    import sys

    code = "import os, pagedllm, torch; print(os.environ['OMP_WAIT_POLICY'])"
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.stdout.strip() == "PASSIVE", out.stderr
    env["OMP_WAIT_POLICY"] = "ACTIVE"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.stdout.strip() == "ACTIVE", out.stderr
