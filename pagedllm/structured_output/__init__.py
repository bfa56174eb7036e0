"""Structured outputs (JSON schema, regex, choice, EBNF grammar, structural tag) backed by xgrammar.

- `config.py`: the engine argument `structured_outputs_config`.
- `backend.py`: constraint -> xgrammar compiled grammar; `validate` for the front end (no tokenizer).
- `manager.py` (engine core): compile threads + cache, one matcher per request, the step's bitmask; the
  scheduler holds a structured request WAITING_FOR_FSM until its grammar is compiled.
- `apply.py` (model runner): the bitmask applied to the sampled rows' logits before sampling.
"""

from __future__ import annotations

from pagedllm.structured_output.config import StructuredOutputsConfig

__all__ = ["StructuredOutputsConfig"]
