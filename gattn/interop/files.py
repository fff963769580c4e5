"""The files of a Hugging Face model folder, for every family: its tensors (safetensors, one file
or an index of shards, or pytorch_model.bin files), its JSON files, and the one-line error a
folder that cannot be converted raises."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some exports carry


class ConversionError(ValueError):
    """A Hugging Face folder or a gattn run that cannot be converted; names the file, tensor or field."""


def read_json(path: Path, text: str | bytes | None = None) -> dict:
    """The JSON object in file `path` (or in `text`, read from it): anything else is one line
    naming the file and where the JSON breaks."""
    try:
        data = json.loads(path.read_bytes() if text is None else text)
    except json.JSONDecodeError as e:
        raise ConversionError(f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except UnicodeDecodeError as e:
        raise ConversionError(f"{path}: not valid JSON (not UTF-8 at byte offset {e.start})") from None
    if not isinstance(data, dict):
        raise ConversionError(f"{path}: expected a JSON object, not a {type(data).__name__}")
    return data


# --------------------------------------------------------------------------- tensors on disk


class TensorFiles:
    """The tensors of a model folder: safetensors (one file or an index of shards) or
    pytorch_model.bin files (read with torch, if installed). Nothing is read until `get`."""

    def __init__(self, src: Path):
        self.src, self.where = src, {}
        index = next((src / n for n in ("model.safetensors.index.json", "pytorch_model.bin.index.json")
                      if (src / n).is_file()), None)
        if index is not None:
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ConversionError(f"{index}: no 'weight_map' object (tensor name -> shard file)")
        else:
            single = next((n for n in ("model.safetensors", "pytorch_model.bin") if (src / n).is_file()), None)
            if single is None:
                raise ConversionError(f"{src}: no model.safetensors, pytorch_model.bin or index of shards")
            weight_map = {name: single for name in self._names(src / single)}
        for name, shard in weight_map.items():
            if not (src / shard).is_file():
                raise ConversionError(f"shard {shard} (holding tensor {name}) is missing from {src}")
        self.where = weight_map
        self._open, self._stored, self._derived, self._fused = {}, {}, {}, {}

    @staticmethod
    def _names(path: Path) -> list[str]:
        if path.suffix == ".safetensors":
            from safetensors import safe_open  # noqa: PLC0415

            with safe_open(path, framework="flax") as f:
                return list(f.keys())
        return list(_torch_load(path))

    def _file(self, shard: str):
        if shard not in self._open:
            path = self.src / shard
            if path.suffix == ".safetensors":
                from safetensors import safe_open  # noqa: PLC0415

                self._open[shard] = safe_open(path, framework="flax")
            else:
                self._open[shard] = _torch_load(path)
        return self._open[shard]

    def names(self) -> list[str]:
        return list(self.where)

    def drop(self, prefix: str) -> list[str]:
        """Leaves out the tensors whose names start with `prefix` (a vision tower); returns their names."""
        dropped = [n for n in self.where if n.startswith(prefix)]
        for name in dropped:
            del self.where[name]
        return dropped

    def rename(self, old: str, new: str) -> None:
        """Reads the tensors stored as `old` + rest under the names `new` + rest (a multimodal
        checkpoint's language model, under its own prefix beside a vision tower)."""
        self._stored = {new + n[len(old):]: n for n in self.where if n.startswith(old)}
        self.where = {(new + n[len(old):] if n.startswith(old) else n): shard for n, shard in self.where.items()}

    def derive(self, fused: str, shape: tuple[int, ...], parts: dict[str, tuple]) -> None:
        """Reads stored tensor `fused` (checked to have `shape` when first read) as the tensors
        `parts` ({name: index into it}): experts a checkpoint stores in one tensor, read per expert."""
        shard = self.where.pop(fused)
        for name, index in parts.items():
            self.where[name] = shard
            self._derived[name] = (fused, shard, shape, index)

    def get(self, name: str) -> np.ndarray:
        """The tensor in float32 (bf16 and fp16 widen exactly)."""
        if name in self._derived:
            fused, shard, shape, index = self._derived[name]
            return self._read_fused(fused, shard, shape)[index]
        return self._read(self._stored.get(name, name), self.where[name])

    def _read(self, stored: str, shard: str) -> np.ndarray:
        f = self._file(shard)
        if isinstance(f, dict):
            return f[stored].float().numpy()
        return np.asarray(f.get_tensor(stored), dtype=np.float32)

    def _read_fused(self, fused: str, shard: str, shape: tuple[int, ...]) -> np.ndarray:
        """A fused expert tensor, checked, and kept while its slices are read (the layer's two)."""
        if fused not in self._fused:
            if len(self._fused) >= 2:
                self._fused.pop(next(iter(self._fused)))
            self._fused[fused] = self._read(self._stored.get(fused, fused), shard)
            if self._fused[fused].shape != shape:
                raise ConversionError(f"tensor {self._stored.get(fused, fused)} has shape "
                                      f"{self._fused[fused].shape}; config.json implies {shape}")
        return self._fused[fused]


def _torch_load(path: Path) -> dict:
    try:
        import torch  # noqa: PLC0415
    except ImportError:
        raise ConversionError(f"{path} is a PyTorch pickle: install torch to read it, or save the model "
                              "with safetensors (save_pretrained(..., safe_serialization=True))") from None
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
