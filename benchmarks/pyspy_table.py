"""Self-time and inclusive-time tables from py-spy's raw (collapsed) stacks: one table per file.

python3 benchmarks/pyspy_table.py pyspy_S2_1234.txt [...]
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterator


def samples(path: str) -> Iterator[tuple[list[str], int]]:
    """(frames root first, sample count) for each line of a py-spy raw (collapsed) file."""
    with open(path) as f:
        for line in f:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            if stack and n.isdigit():
                yield stack.split(";"), int(n)


def tables(path: str, top: int = 25) -> str:
    self_t: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    total = 0
    for frames, k in samples(path):
        total += k
        self_t[frames[-1]] += k
        for fr in set(frames):
            incl[fr] += k
    out = [f"==== {path}: {total} samples"]
    out.append("-- self time")
    out += [f"{100 * v / max(total, 1):6.1f}%  {k[:150]}" for k, v in self_t.most_common(top)]
    out.append("-- inclusive time")
    out += [f"{100 * v / max(total, 1):6.1f}%  {k[:150]}" for k, v in incl.most_common(top)]
    return "\n".join(out)


if __name__ == "__main__":
    print("\n\n".join(tables(p) for p in sys.argv[1:]))
