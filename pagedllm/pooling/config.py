"""Which runner a model gets, which pooling tasks it serves and how it pools.

`runner="auto"` picks "pooling" for encoder-only / sequence-classification architectures and for
sentence-transformers checkpoints (`modules.json`); a decoder-only model run as a pooling model gets
`convert="embed"` (last-token pooling, normalized: Qwen3-Embedding's shape) unless `convert="classify"`.
The pooling type and normalization come from the sentence-transformers files (`modules.json`,
`1_Pooling/config.json`, a `Normalize` module) when present; `pooler_config` overrides them."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from typing import Any

import torch

ENCODER_ARCHS = (
    "BertModel",
    "BertForSequenceClassification",
    "XLMRobertaModel",
    "XLMRobertaForSequenceClassification",
    "RobertaModel",
    "RobertaForSequenceClassification",
)
POOLING_TYPES = ("LAST", "CLS", "MEAN", "ALL")
EMBED_TASKS = ("encode", "embed", "token_embed")
CLASSIFY_TASKS = ("encode", "classify", "score", "reward", "token_classify")
RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify")


@dataclass
class PoolerConfig:
    """vLLM's `pooler_config` (the fields this engine uses)."""

    pooling_type: str | None = None
    normalize: bool | None = None
    use_activation: bool | None = None

    @staticmethod
    def parse(value: PoolerConfig | dict[str, Any] | str | None) -> PoolerConfig:
        if value is None:
            return PoolerConfig()
        if isinstance(value, PoolerConfig):
            return value
        if isinstance(value, str):
            value = json.loads(value)
        if not isinstance(value, dict):
            raise ValueError(f"pooler_config: expected a JSON object, got {type(value).__name__}")
        names = {f.name for f in fields(PoolerConfig)}
        unknown = set(value) - names
        if unknown:
            raise ValueError(f"pooler_config: unknown field(s) {', '.join(sorted(unknown))}")
        cfg = PoolerConfig(**value)
        if cfg.pooling_type is not None:
            cfg.pooling_type = cfg.pooling_type.upper()
            if cfg.pooling_type not in POOLING_TYPES:
                raise ValueError(f"pooler_config.pooling_type: expected one of {POOLING_TYPES}, got {value}")
        return cfg


def _read_json(path: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def sentence_transformers_config(model_dir: str) -> tuple[PoolerConfig, int | None] | None:
    """(pooler config, max_seq_length) from a sentence-transformers checkpoint, None if it is not one."""
    modules = _read_json(os.path.join(model_dir, "modules.json"))
    if not isinstance(modules, list):
        return None
    cfg = PoolerConfig(normalize=False)
    for m in modules:
        mtype = str(m.get("type", ""))
        if mtype.endswith("Normalize"):
            cfg.normalize = True
        elif mtype.endswith("Pooling"):
            pc = _read_json(os.path.join(model_dir, m.get("path", ""), "config.json")) or {}
            if pc.get("pooling_mode_cls_token"):
                cfg.pooling_type = "CLS"
            elif pc.get("pooling_mode_mean_tokens"):
                cfg.pooling_type = "MEAN"
            elif pc.get("pooling_mode_lasttoken"):
                cfg.pooling_type = "LAST"
            else:
                modes = [k for k, v in pc.items() if k.startswith("pooling_mode") and v]
                raise ValueError(f"sentence-transformers pooling mode(s) {modes} are not supported")
    st = _read_json(os.path.join(model_dir, "sentence_bert_config.json")) or {}
    max_len = st.get("max_seq_length")
    return cfg, int(max_len) if max_len else None


def is_pooling_arch(archs: list[str]) -> bool:
    return any(a in ENCODER_ARCHS or a.endswith(("ForSequenceClassification", "ForRewardModel")) for a in archs)


@dataclass
class PoolingSetup:
    runner_type: str
    convert: str
    pooler_config: PoolerConfig
    tasks: tuple[str, ...]
    encoder_only: bool
    max_seq_length: int | None
    bf16_gemms: bool = False
    """CPU, encoder-only: float32 weights with bf16 GEMMs (`pooling/cpu_mixed.py`)."""


def resolve_pooling(
    runner: str, convert: str, pooler_config: Any, archs: list[str], model_dir: str, hf_config: Any
) -> PoolingSetup:
    """The runner, conversion, pooler config and tasks of a model (see the module docstring)."""
    if runner not in RUNNERS:
        raise ValueError(f"runner: expected one of {RUNNERS}, got {runner!r}")
    if convert not in CONVERTS:
        raise ValueError(f"convert: expected one of {CONVERTS}, got {convert!r}")
    st = sentence_transformers_config(model_dir) if os.path.isdir(model_dir) else None
    if runner == "auto":
        runner = (
            "pooling" if (is_pooling_arch(archs) or st is not None or convert in ("embed", "classify")) else "generate"
        )
    if runner == "generate":
        if convert in ("embed", "classify"):
            raise ValueError(f"convert={convert!r} needs runner='pooling'")
        return PoolingSetup("generate", "none", PoolerConfig(), (), False, None)
    encoder = any(a in ENCODER_ARCHS for a in archs)
    classifier = any(a.endswith("ForSequenceClassification") for a in archs)
    if convert == "auto":
        convert = "none" if encoder else ("classify" if classifier else "embed")
    if encoder and convert != "none":
        raise ValueError(f"convert={convert!r}: {archs[0]} is a pooling model already (leave convert='auto')")
    is_cls = classifier or convert == "classify"
    base = PoolerConfig()
    if st is not None:
        base = st[0]
    elif encoder:
        base = PoolerConfig(pooling_type="CLS", normalize=not is_cls)
    else:
        base = PoolerConfig(pooling_type="LAST", normalize=True)
    if is_cls and not st:
        base.pooling_type = "CLS" if encoder else "LAST"
    user = PoolerConfig.parse(pooler_config)
    merged = PoolerConfig(
        pooling_type=user.pooling_type or base.pooling_type,
        normalize=user.normalize if user.normalize is not None else base.normalize,
        use_activation=user.use_activation if user.use_activation is not None else base.use_activation,
    )
    tasks = CLASSIFY_TASKS if is_cls else EMBED_TASKS
    return PoolingSetup("pooling", convert, merged, tasks, encoder, st[1] if st else None)


def apply_pooling(args: Any, mc: Any, max_batched: int) -> dict[str, Any]:
    """Resolve the runner into `mc` (runner_type, pooling, max_model_len from sentence-transformers'
    max_seq_length) and return the engine settings a pooling model needs: no prefix caching (mean / all
    pooling need every position's hidden state), no async scheduling (a pooling request's result is the
    step's output); an encoder-only model also no chunked prefill (bidirectional attention needs the whole
    sequence in one step), a step budget that holds many sequences, and just the blocks that budget uses
    (they only account for the step's tokens: an encoder keeps no KV)."""
    from pagedllm.model_executor.model_loader.loader import get_architectures

    setup = resolve_pooling(
        args.runner, args.convert, args.pooler_config, get_architectures(mc.hf_config), mc.model_dir, mc.hf_config
    )
    mc.runner_type = setup.runner_type
    if setup.runner_type != "pooling":
        return {}
    mc.pooling = setup
    if args.max_model_len is None and setup.max_seq_length:
        mc.max_model_len = min(mc.max_model_len, setup.max_seq_length)
    if setup.convert == "classify":
        mc.hf_config.pagedllm_convert = "classify"
        archs = get_architectures(mc.hf_config)
        mc.hf_config.architectures = [a.replace("ForSequenceClassification", "ForCausalLM") for a in archs]
    out: dict[str, Any] = {"enable_prefix_caching": False, "async_scheduling": False}
    if setup.encoder_only:
        from pagedllm.pooling import cpu_mixed

        if cpu_mixed.choose(args.dtype, mc.hf_config, args.resolved_device()):
            mc.dtype, setup.bf16_gemms = torch.float32, True
        if getattr(mc.hf_config, "sep_token_id", None) is None and not mc.skip_tokenizer_init:
            mc.hf_config.sep_token_id = _sep_token_id(mc.tokenizer if mc.tokenizer != mc.model else mc.model_dir)
        batched = max(max_batched if args.max_num_batched_tokens else 16384, mc.max_model_len)
        max_seqs = args.max_num_seqs or 256
        block = args.block_size
        out.update(
            enable_chunked_prefill=False,
            max_num_batched_tokens=batched,
            num_gpu_blocks_override=args.num_gpu_blocks_override or (-(-batched // block) + max_seqs + 1),
        )
    return out


def _sep_token_id(tokenizer_path: str) -> int | None:
    """The [SEP] id (token types of text pairs) from the tokenizer files."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(tokenizer_path)
    except (OSError, ValueError):
        return None
    return getattr(tok, "sep_token_id", None)
