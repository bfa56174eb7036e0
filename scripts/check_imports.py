"""Import-graph checks for CI: no import cycle among pagedllm's modules (imports inside functions count too),
and `pagedllm.core` imports nothing from `pagedllm.engine`, `pagedllm.entrypoints` or `pagedllm.worker`."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = {"pagedllm.core": ("pagedllm.engine", "pagedllm.entrypoints", "pagedllm.worker")}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, name: str, modules: set[str]) -> set[str]:
    """The pagedllm modules `path` imports anywhere in its body (an imported name that is a submodule counts
    as that submodule)."""
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.add(sub if sub in modules else base)
    return {m for m in out if m in modules and m != name}


def main() -> int:
    files = {module_name(p): p for p in (ROOT / "pagedllm").rglob("*.py")}
    modules = set(files)
    graph = {m: imports_of(p, m, modules) for m, p in files.items()}
    errors = []
    for src, targets in graph.items():
        for prefix, banned in FORBIDDEN.items():
            if src == prefix or src.startswith(prefix + "."):
                errors += [f"{src} imports {t}" for t in sorted(targets) if t.startswith(banned)]
    # Cycles: strongly connected components of more than one module (Tarjan, iterative).
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, it = work[-1]
            for nxt in it:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        m = stack.pop()
                        on_stack.discard(m)
                        comp.append(m)
                        if m == node:
                            break
                    if len(comp) > 1:
                        errors.append("import cycle: " + " <-> ".join(sorted(comp)))
    for e in errors:
        print(e)
    print(f"{len(graph)} modules, {len(errors)} import problems")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
