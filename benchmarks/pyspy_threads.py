"""Per-thread tables from py-spy raw samples taken with --threads (and --idle): for each thread, its sample
count, its top self frames and (the step loop) its top inclusive frames inside structured_overhead.py's timed
decode loop. Used by benchmarks/structured_pyspy.sh.

    python3 benchmarks/pyspy_threads.py pyspy_structured.txt
"""

from __future__ import annotations

import sys
from collections import Counter, defaultdict

from pyspy_table import samples


def timed_loop_frame() -> str:
    """How the frame of the timed `engine.step()` call in structured_overhead.time_decode ends (file:line)."""
    path = "benchmarks/structured_overhead.py"
    with open(path) as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        if "times.append(time.perf_counter() - t)" in line:
            return f"structured_overhead.py:{i})"  # the engine.step() line just above (1-based: i)
    raise SystemExit("timed loop not found")


def main(path: str, top: int = 22) -> None:
    loop = timed_loop_frame()
    total: Counter[str] = Counter()
    self_t: dict[str, Counter[str]] = defaultdict(Counter)
    incl_loop: Counter[str] = Counter()
    in_loop = 0
    for frames, k in samples(path):
        thread = next((fr for fr in frames if fr.startswith("thread (")), "?")
        frames = [fr for fr in frames if not fr.startswith(("thread (", "process "))]
        total[thread] += k
        self_t[thread][frames[-1] if frames else "?"] += k
        at = next((i for i, fr in enumerate(frames) if fr.startswith("time_decode (") and fr.endswith(loop)), None)
        if at is not None:
            in_loop += k
            for fr in set(frames[at + 1 :]):
                incl_loop[fr] += k
    for thread, n in total.most_common():
        print(f"==== {thread}: {n} samples")
        for fr, v in self_t[thread].most_common(top):
            print(f"{100 * v / n:6.1f}%  {fr[:140]}")
    print(f"==== inside the timed decode loop ({loop}): {in_loop} samples, inclusive")
    for fr, v in incl_loop.most_common(top * 2):
        print(f"{100 * v / max(in_loop, 1):6.1f}%  {fr[:140]}")


if __name__ == "__main__":
    main(sys.argv[1])
