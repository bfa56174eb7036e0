"""Running a check script under the Triton interpreter from a CPU test: TRITON_INTERPRET must be set before triton
is imported and must not leak into the other test modules of the pytest process, so the script runs in a
subprocess; it prints its result on its last line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_interpreted(script: Path, timeout: float = 600, args: list[str] | None = None) -> str:
    """The last line `script` printed (run with `args`), with TRITON_INTERPRET=1 and this checkout first on the
    path (an AssertionError with the end of its stderr if it failed)."""
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [sys.executable, str(script), *(args or [])]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout.strip().splitlines()[-1]
