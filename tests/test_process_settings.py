"""The daemons' process-wide settings (``shared.config``): OpenMP waiting, the start-up heap."""

from __future__ import annotations

import gc
import os

import pytest

from shared import config
from shared.config import (SERVER_SPIN_COUNT, SHARED_CPU_SPIN_COUNT, environment_for_peers, freeze_start_up_heap,
                           set_openmp_wait_defaults)


@pytest.fixture(autouse=True)
def no_openmp_settings(monkeypatch):
    """Each test starts with neither OpenMP variable, set by the user or by ``set_openmp_wait_defaults``,
    and leaves the environment and the module as it found them."""
    monkeypatch.setattr(config, "_OWN_OPENMP_SETTINGS", set())
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.setenv(name, "")  # NOTE: records the value to restore, which delenv alone does not when absent
        monkeypatch.delenv(name)


def test_openmp_wait_defaults_do_not_override_the_environment(monkeypatch):
    monkeypatch.setenv("GOMP_SPINCOUNT", "7")
    set_openmp_wait_defaults(SERVER_SPIN_COUNT)
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE" and os.environ["GOMP_SPINCOUNT"] == "7"


def test_openmp_wait_defaults_spin_as_the_daemon_asks(monkeypatch):
    for spin in (SERVER_SPIN_COUNT, SHARED_CPU_SPIN_COUNT):
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
        monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
        set_openmp_wait_defaults(spin)
        assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE" and os.environ["GOMP_SPINCOUNT"] == str(spin)


def test_peers_get_the_users_openmp_settings_not_the_daemons(monkeypatch):
    monkeypatch.setenv("GOMP_SPINCOUNT", "7")  # the user's
    set_openmp_wait_defaults(SERVER_SPIN_COUNT)  # sets OMP_WAIT_POLICY only
    peers = environment_for_peers()
    assert "OMP_WAIT_POLICY" not in peers and peers["GOMP_SPINCOUNT"] == "7"
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"  # the daemon's own process keeps its setting
    assert {k: v for k, v in peers.items() if k != "GOMP_SPINCOUNT"} == {
        k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}


def test_the_start_up_heap_leaves_the_collectors_passes():
    built_at_start_up = [object() for _ in range(1000)]
    try:
        freeze_start_up_heap()
        assert gc.get_freeze_count() >= len(built_at_start_up)
    finally:
        gc.unfreeze()
