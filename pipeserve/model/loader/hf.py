"""Hugging Face checkpoint directories: config.json and (sharded) safetensors."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from pipeserve.model.config import SUPPORTED_ARCHITECTURES, ModelConfig
from pipeserve.model.families import refuse_unsupported
from pipeserve.model.moe import refuse_moe_switches

INDEX_FILE = "model.safetensors.index.json"


def read_hf_config(directory: Path) -> ModelConfig:
    path = directory / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{directory} has no config.json; is it a Hugging Face model directory?")
    raw = json.loads(path.read_text())
    archs = raw.get("architectures") or ["LlamaForCausalLM"]
    if archs[0] not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"architecture {archs[0]!r} in {path} is not supported; pipeserve runs "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    refuse_moe_switches(raw, path)
    refuse_unsupported(raw, path)
    return ModelConfig.from_hf_dict(raw)


class SafetensorsReader:
    """Reads single tensors by name, opening only the shards that hold them."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.names_read: list[str] = []
        self._file_of = _tensor_files(directory)
        self._handles: dict[Path, object] = {}

    def names(self) -> set[str]:
        return set(self._file_of)

    def read(self, name: str) -> torch.Tensor:
        file = self._file_of.get(name)
        if file is None:
            untied = " (config.json sets tie_word_embeddings false)" if name == "lm_head.weight" else ""
            raise KeyError(f"tensor {name!r} is not in the checkpoint at {self.directory}{untied}")
        if file not in self._handles:
            self._handles[file] = safe_open(str(file), framework="pt", device="cpu")
        self.names_read.append(name)
        return self._handles[file].get_tensor(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def read_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Rows (dim 0) or columns (dim 1) [start, stop) of tensor ``name``, reading only those
        bytes where the layout allows (a tensor-parallel rank's shard)."""
        part = self._slice(name)
        self.names_read.append(name)
        return part[start:stop] if dim == 0 else part[:, start:stop]

    def _slice(self, name: str):
        file = self._file_of.get(name)
        if file is None:
            raise KeyError(f"tensor {name!r} is not in the checkpoint at {self.directory}")
        if file not in self._handles:
            self._handles[file] = safe_open(str(file), framework="pt", device="cpu")
        return self._handles[file].get_slice(name)

    def close(self) -> None:
        self._handles.clear()


def _tensor_files(directory: Path) -> dict[str, Path]:
    index = directory / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: directory / file for name, file in weight_map.items()}
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory} has no *.safetensors weights (pytorch .bin checkpoints "
                                "are not supported; convert them to safetensors)")
    mapping: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:  # reads the header only
            mapping.update({name: file for name in f.keys()})
    return mapping
