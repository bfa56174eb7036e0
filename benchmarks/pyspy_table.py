"""Self-time and inclusive-time tables from py-spy's raw (collapsed) stacks: one table per file.

python3 benchmarks/pyspy_table.py pyspy_S2_1234.txt [...]
"""

from __future__ import annotations

import sys
from collections import Counter


def tables(path: str, top: int = 25) -> str:
    self_t: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    total = 0
    with open(path) as f:
        for line in f:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            if not stack or not n.isdigit():
                continue
            k = int(n)
            total += k
            frames = stack.split(";")
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
