"""CLI flags generated from a dataclass's fields (`EngineArgs.add_cli_args`): one `--kebab-case` flag per field,
booleans also as `--no-...`, grouped by each field's `group` metadata, help from its `help` metadata."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any, Literal, get_args, get_origin, get_type_hints


def add_dataclass_args(
    cls: type, parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()
) -> argparse.ArgumentParser:
    """One flag per field of `cls` except `skip`; list fields take one or more values, dicts a JSON string,
    Literals their choices."""
    hints = get_type_hints(cls)
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        meta = f.metadata
        gname = meta.get("group", "Model")
        group = groups.get(gname) or groups.setdefault(gname, parser.add_argument_group(f"{gname} options"))
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else None
        kw: dict[str, Any] = {"dest": f.name, "default": default, "help": meta.get("help", "")}
        base, choices, nargs = _unwrap(hints[f.name])
        if base is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
            continue
        if base is dict:
            kw["type"] = json.loads
        elif base in (int, float, str):
            kw["type"] = base
        if choices:
            kw["choices"] = choices
        if nargs:
            kw["nargs"] = "+"
        group.add_argument(flag, **kw)
    return parser


def _unwrap(tp: Any) -> tuple[Any, list[Any] | None, bool]:
    """(base type, choices for Literal, list?) of an annotation like `int | None` or `list[str] | None`."""
    origin = get_origin(tp)
    args = [a for a in get_args(tp) if a is not type(None)]
    if origin is Literal:
        return str, list(get_args(tp)), False
    if args and origin is not None and origin not in (list, dict):
        return _unwrap(args[0])
    if origin is list:
        return _unwrap(args[0])[0], None, True
    if origin is dict:
        return dict, None, False
    return tp, None, False
