"""The models a server answers to (vLLM's `OpenAIServingModels`): the base model's served names and the LoRA
adapters (`--lora-modules`, and at run time `/v1/load_lora_adapter` / `/v1/unload_lora_adapter` when
PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING or VLLM_ALLOW_RUNTIME_LORA_UPDATING is set). `model=<adapter name>` in a
request selects the adapter."""

from __future__ import annotations

import asyncio
import itertools
import json
from dataclasses import dataclass
from typing import Any

from pagedllm.entrypoints.openai.errors import OpenAIServingError
from pagedllm.entrypoints.openai.protocol import ModelCard
from pagedllm.lora.request import LoRARequest


@dataclass
class LoRAModulePath:
    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(value: str) -> LoRAModulePath:
    """`name=path` or `{"name": ..., "path": ..., "base_model_name": ...}` (vLLM's two forms)."""
    text = value.strip()
    if text.startswith("{"):
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--lora-modules: invalid JSON {value!r}: {e}") from e
        if not isinstance(d, dict) or not isinstance(d.get("name"), str) or not isinstance(d.get("path"), str):
            raise ValueError(f'--lora-modules: expected {{"name": str, "path": str, ...}}, got {value!r}')
        extra = set(d) - {"name", "path", "base_model_name"}
        if extra:
            raise ValueError(f"--lora-modules: unknown keys {sorted(extra)} in {value!r}")
        return LoRAModulePath(d["name"], d["path"], d.get("base_model_name"))
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules: expected name=path or a JSON object, got {value!r}")
    return LoRAModulePath(name, path)


class OpenAIServingModels:
    def __init__(self, engine: Any, served_model_names: list[str]) -> None:
        self.engine = engine
        self.served_model_names = served_model_names
        self.lora_requests: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        """A fresh id per load: a name loaded again (maybe with new files) never reuses cached weights."""

    def lora_for(self, model: str | None) -> LoRARequest | None:
        return self.lora_requests.get(model) if model else None

    def is_served(self, model: str) -> bool:
        return model in self.served_model_names or model in self.lora_requests

    def model_cards(self, **extra: Any) -> list[ModelCard]:
        """The served names and the adapters; `extra`: fields for the base model's cards (its task)."""
        mc = self.engine.model_config
        cards = [
            ModelCard(id=n, root=mc.model, max_model_len=mc.max_model_len, **extra) for n in self.served_model_names
        ]
        for lr in self.lora_requests.values():
            parent = lr.base_model_name or self.served_model_names[0]
            cards.append(ModelCard(id=lr.lora_name, root=lr.lora_path, parent=parent, max_model_len=mc.max_model_len))
        return cards

    def load_static(self, modules: list[LoRAModulePath]) -> None:
        """The `--lora-modules` at start-up (ValueError: the server does not start)."""
        for m in modules:
            if m.name in self.lora_requests or m.name in self.served_model_names:
                raise ValueError(f"--lora-modules: the name {m.name!r} is given twice")
            lr = LoRARequest(m.name, next(self._ids), m.path, m.base_model_name)
            self.engine.input_processor.validate_lora(lr)
            self.lora_requests[m.name] = lr

    async def load_lora_adapter(self, name: Any, path: Any, base_model_name: str | None = None) -> str:
        """Validates the adapter off the event loop (config + tensor shapes) and registers it; 400 on error."""
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise OpenAIServingError("Both 'lora_name' and 'lora_path' must be provided.", 400, "lora_name")
        if self.engine.input_processor.lora_config is None:
            raise OpenAIServingError("LoRA is not enabled: start the server with --enable-lora.", 400)
        if name in self.lora_requests or name in self.served_model_names:
            raise OpenAIServingError(f"The lora adapter '{name}' has already been loaded.", 400, "lora_name")
        try:
            lr = LoRARequest(name, next(self._ids), path, base_model_name)
            await asyncio.to_thread(self.engine.input_processor.validate_lora, lr)
        except ValueError as e:
            raise OpenAIServingError(str(e), 400, "lora_path") from e
        self.lora_requests[name] = lr
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload_lora_adapter(self, name: Any) -> str:
        if not isinstance(name, str) or not name:
            raise OpenAIServingError("'lora_name' needs to be provided to unload a LoRA adapter.", 400, "lora_name")
        if self.lora_requests.pop(name, None) is None:
            raise OpenAIServingError(f"The lora adapter '{name}' cannot be found.", 404, "lora_name")
        return f"Success: LoRA adapter '{name}' removed successfully."
