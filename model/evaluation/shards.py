"""Hugging Face safetensors shards, written one tensor at a time.

A shard is planned from names, shapes and dtypes alone (its header is written first), then
each tensor is fetched, written and dropped, so writing never holds more than the tensor
being written. The layout is what ``transformers`` writes and reads: one
``model.safetensors``, or ``model-0000i-of-0000N.safetensors`` files plus
``model.safetensors.index.json`` (``weight_map``: tensor name -> file).

File format (safetensors): 8-byte little-endian header length, a JSON header
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`` padded
with spaces to a multiple of 8, then the tensors' bytes in offset order.
"""
from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 5 * 10**9  # what transformers' save_pretrained uses ("5GB")

_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
           torch.float64: "F64", torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8",
           torch.int8: "I8", torch.bool: "BOOL"}


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a shard: its name, shape and dtype (known before its data)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count * torch.empty((), dtype=self.dtype).element_size()


def plan_shards(specs: list[TensorSpec], shard_bytes: int) -> list[list[TensorSpec]]:
    """Split ``specs`` (in order) into shards of at most ``shard_bytes`` each; a tensor
    larger than ``shard_bytes`` gets a shard of its own (as transformers does)."""
    if shard_bytes <= 0:
        raise ValueError(f"shard size must be > 0 bytes, got {shard_bytes}")
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


def shard_names(count: int) -> list[str]:
    """File names of ``count`` shards (one shard: ``model.safetensors``)."""
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def _header(specs: list[TensorSpec], metadata: dict[str, str]) -> bytes:
    entries: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for spec in specs:
        if spec.dtype not in _DTYPES:
            raise ValueError(f"{spec.name}: dtype {spec.dtype} has no safetensors code")
        entries[spec.name] = {"dtype": _DTYPES[spec.dtype], "shape": list(spec.shape),
                              "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_shard(path: Path, specs: list[TensorSpec],
                fetch: Callable[[TensorSpec], torch.Tensor],
                metadata: dict[str, str] | None = None) -> None:
    """Write one safetensors file, fetching (and then dropping) one tensor at a time.

    ``fetch(spec)`` returns the tensor; its shape and dtype must match the spec.
    """
    with open(path, "wb") as handle:
        handle.write(_header(specs, metadata or {"format": "pt"}))
        for spec in specs:
            tensor = fetch(spec)
            if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
                raise ValueError(f"{spec.name}: got {tuple(tensor.shape)} {tensor.dtype}, "
                                 f"planned {spec.shape} {spec.dtype}")
            flat = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            handle.write(memoryview(flat.numpy()))
            del tensor, flat


def write_sharded(out_dir: Path, specs: list[TensorSpec],
                  fetch: Callable[[TensorSpec], torch.Tensor], shard_bytes: int) -> list[str]:
    """Write ``specs`` as shards into ``out_dir`` (+ the index when more than one);
    return the shard file names."""
    shards = plan_shards(specs, shard_bytes)
    names = shard_names(len(shards))
    for name, shard in zip(names, shards):
        write_shard(out_dir / name, shard, fetch)
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(s.nbytes for s in specs)},
                 "weight_map": {s.name: name for name, shard in zip(names, shards)
                                for s in shard}}
        (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True))
    return names


def weight_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> file of an HF model directory's weights (safetensors or .bin,
    single or sharded); FileNotFoundError naming what was looked for."""
    for single, index in ((SINGLE_FILE, INDEX_FILE),
                          ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        if (model_dir / index).is_file():
            weight_map = json.loads((model_dir / index).read_text())["weight_map"]
            return {name: model_dir / file for name, file in weight_map.items()}
        if (model_dir / single).is_file():
            return {name: model_dir / single for name in _names_in(model_dir / single)}
    raise FileNotFoundError(
        f"{model_dir} has no {SINGLE_FILE}, {INDEX_FILE}, pytorch_model.bin or "
        "pytorch_model.bin.index.json")


def _names_in(path: Path) -> list[str]:
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), "pt") as handle:
            return list(handle.keys())
    return list(_load_bin(path))


def _load_bin(path: Path) -> dict[str, torch.Tensor]:
    """A ``.bin`` state dict, memory-mapped and with ``weights_only=True`` (no code runs)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # the legacy (non-zip) format cannot be memory-mapped
        return torch.load(path, map_location="cpu", weights_only=True)


class TensorReader:
    """Reads named tensors of an HF directory one at a time (safetensors opened lazily,
    ``.bin`` files memory-mapped), keeping at most one file open."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files = files
        self._path: Path | None = None
        self._handle = None

    def get(self, name: str) -> torch.Tensor:
        """The tensor ``name`` (a fresh CPU tensor for safetensors, mapped for .bin)."""
        path = self.files[name]
        if path != self._path:
            self._path = path
            if path.suffix == ".safetensors":
                from safetensors import safe_open

                self._handle = safe_open(str(path), "pt")
            else:
                self._handle = _load_bin(path)
        if isinstance(self._handle, dict):
            return self._handle[name]
        return self._handle.get_tensor(name)

    def spec(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        """Shape and dtype of ``name`` without reading its data (safetensors)."""
        path = self.files[name]
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), "pt") as handle:
                sl = handle.get_slice(name)
                dtype = {v: k for k, v in _DTYPES.items()}[sl.get_dtype()]
                return tuple(sl.get_shape()), dtype
        tensor = self.get(name)
        return tuple(tensor.shape), tensor.dtype

    def names(self) -> Iterator[str]:
        """Every tensor name, in file order."""
        return iter(self.files)
