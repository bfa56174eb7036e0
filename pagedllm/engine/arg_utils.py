"""`EngineArgs`: the ONE definition of the engine's arguments. `LLM(**kwargs)` takes them, and the CLI
flags (`--kebab-case`, booleans also as `--no-...`) are generated from the same dataclass fields."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from pagedllm.config import EngineConfig
from pagedllm.engine.arg_checks import validate
from pagedllm.engine.arg_cli import add_dataclass_args
from pagedllm.engine.arg_fields import EngineArgsFields
from pagedllm.engine.config_builder import build_engine_config


@dataclass
class EngineArgs(EngineArgsFields):
    """The engine's arguments (fields in engine/arg_fields.py), their checks and the `EngineConfig` they make."""

    def _validate(self) -> None:
        """Every argument's check (engine/arg_checks.py): a ValueError naming the argument."""
        validate(self)

    def create_engine_config(self) -> EngineConfig:
        """The validated, resolved `EngineConfig` (engine/config_builder.py); a ValueError names the argument."""
        validate(self)
        return build_engine_config(self)

    # ---- CLI -----------------------------------------------------------------------------------
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, positional_model: bool = False) -> argparse.ArgumentParser:
        """One `--kebab-case` flag per field, grouped by the field's group."""
        return add_dataclass_args(EngineArgs, parser, skip=("model",) if positional_model else ())

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}
