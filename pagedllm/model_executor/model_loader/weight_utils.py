"""Finding checkpoint files and iterating over their tensors."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator

import torch
from torch import nn

SAFETENSORS_INDEX = "model.safetensors.index.json"
PT_INDEX = "pytorch_model.bin.index.json"


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
    """Copies a whole (unsharded) tensor into a parameter of the same shape."""
    if param.shape != loaded_weight.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded_weight.shape)}")
    param.data.copy_(loaded_weight)


def _files_from_index(model_dir: str, index_name: str) -> list[str] | None:
    path = os.path.join(model_dir, index_name)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        weight_map = json.load(f)["weight_map"]
    return [os.path.join(model_dir, name) for name in sorted(set(weight_map.values()))]


def get_safetensors_files(model_dir: str) -> list[str]:
    """The shards listed in model.safetensors.index.json, else every *.safetensors file in the dir."""
    files = _files_from_index(model_dir, SAFETENSORS_INDEX)
    if files is None:
        files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    return files


def get_pt_files(model_dir: str) -> list[str]:
    files = _files_from_index(model_dir, PT_INDEX)
    if files is None:
        files = sorted(
            f
            for f in glob.glob(os.path.join(model_dir, "*.bin"))
            if not os.path.basename(f).startswith("training_args")
        )
    return files


_ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def safetensors_weights_iterator(files: list[str], mapped: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) for every tensor of the files. `mapped`: views of a private memory map of each file
    (no copy), so a tensor-parallel rank that narrows a weight to its shard reads only those pages."""
    from safetensors import safe_open

    for path in files:
        if mapped:
            tensors = _mapped_safetensors(path)
            if tensors is not None:
                yield from tensors
                continue
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                yield name, f.get_tensor(name)


def _mapped_safetensors(path: str) -> list[tuple[str, torch.Tensor]] | None:
    """The file's tensors as views of `UntypedStorage.from_file` (a private mmap: pages are read when
    touched); None when a tensor's dtype or alignment does not allow a view (then they are read whole)."""
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
    base = 8 + header_len
    storage = torch.UntypedStorage.from_file(path, shared=False, nbytes=os.path.getsize(path))
    out = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _ST_DTYPES.get(info["dtype"])
        if dtype is None:
            return None
        itemsize = torch.empty((), dtype=dtype).element_size()
        start = base + int(info["data_offsets"][0])
        if start % itemsize:
            return None
        t = torch.empty(0, dtype=dtype)
        t.set_(storage, start // itemsize, tuple(info["shape"]))  # type: ignore[call-overload]
        out.append((name, t))
    return out


def pt_weights_iterator(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    for path in files:
        state = torch.load(path, map_location="cpu", weights_only=True)
        yield from state.items()
        del state


def initialize_dummy_weights(model: nn.Module, low: float = -1e-3, high: float = 1e-3, seed: int = 1234) -> None:
    """Deterministic small uniform weights U(low, high) for every parameter, drawn on the parameter's own
    device (an 8B model drawn on the CPU takes ~45 s; on the GPU, well under a second); RMSNorm weights
    are set to 1 so activations keep a sane scale."""
    from pagedllm.model_executor.layers.layernorm import RMSNorm

    norm_params = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    for i, (_, param) in enumerate(model.named_parameters()):
        if id(param) in norm_params:
            param.data.fill_(1.0)
            continue
        if getattr(param, "skip_dummy_init", False):  # e.g. a GPTQ layer's g_idx keeps its trivial order
            continue
        gen = torch.Generator(device=param.device).manual_seed(seed + i)
        if param.dtype in (torch.float16, torch.bfloat16, torch.float32):
            param.data.uniform_(low, high, generator=gen)
        else:
            param.data.copy_(torch.empty(param.shape, device=param.device).uniform_(low, high, generator=gen))
