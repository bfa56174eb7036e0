"""`LoRARequest`: which adapter a request runs with (vLLM's shape and field names)."""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, omit_defaults=True):  # type: ignore[call-arg]
    """A PEFT adapter directory (`adapter_config.json` + `adapter_model.safetensors`) under a name and a
    positive integer id unique per adapter; requests with the same id share the adapter's GPU slot and
    their prefix-cache blocks."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id: must be an integer >= 1, got {self.lora_int_id!r}")
        if not self.lora_path:
            raise ValueError("lora_path: the adapter's directory is required")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
