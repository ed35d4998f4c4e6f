"""`cloudd cluster serve` for real: a local Ray instance with 2 replicas of the default model, in
a network namespace that has only loopback (every Serve replica listens on all interfaces; no
setting moves it). The cases live in ``cases_in_netns.py`` (and ``cloudd bench --cluster``'s in
``bench_cases_in_netns.py``, a two-node Ray cluster's in ``node_cases_in_netns.py``); these tests
run them there with ``unshare -n`` (CI runs as root), and Ray missing is checked here."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from cloudd.cluster import ray_runtime

HERE = Path(__file__).resolve().parent


def test_the_cluster_cases_pass_in_a_loopback_only_namespace():
    run_in_netns("cases_in_netns.py", "bench_cases_in_netns.py")


def test_a_two_node_cluster_loses_no_request_when_a_node_dies_in_a_loopback_only_namespace():
    run_in_netns("node_cases_in_netns.py")


def run_in_netns(*case_files: str) -> None:
    """Run ``case_files``' tests with pytest in a new network namespace that has only loopback."""
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs root and unshare(1) for a loopback-only network namespace (CI has both)")
    cases = " ".join(str(HERE / name) for name in case_files)
    inner = f"ip link set lo up && exec {sys.executable} -m pytest -q -p no:cacheprovider -p no:warnings --tb=short {cases}"
    proc = subprocess.Popen(["unshare", "-n", "sh", "-c", inner], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=HERE.parents[1], start_new_session=True)
    try:
        out, err = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # Ray's processes too: none outlives the test
        out, err = proc.communicate()
    assert proc.returncode == 0, out[-6000:] + err[-3000:]


def test_without_ray_the_cluster_says_how_to_install_it(monkeypatch, capsys, default_model_path):
    from cloudd.__main__ import main

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    with pytest.raises(ray_runtime.ClusterUnavailable, match=r"pip install -e '\.\[cluster\]'"):
        ray_runtime.import_ray()
    assert main(["cluster", "serve", "--model", str(default_model_path)]) == 2
    assert "pip install -e '.[cluster]'" in capsys.readouterr().err
