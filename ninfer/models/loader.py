"""`load_model(path)`: a GGUF file or a Hugging Face style directory."""

from __future__ import annotations

from pathlib import Path

from ninfer.models.errors import ModelLoadError
from ninfer.models.loaded import LoadedModel


def load_model(path: str | Path, *, progress: bool = False) -> LoadedModel:
    """Load a model from a `.gguf` file or a directory with config.json + *.safetensors."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model not found: {path}")
    if path.is_dir():
        from ninfer.models.hf_dir import load_hf_dir

        return load_hf_dir(path, progress=progress)
    from ninfer.models.gguf_file import load_gguf

    return load_gguf(path, progress=progress)
