"""The daemons' process-wide settings (``shared.config``): OpenMP waiting, the start-up heap."""

from __future__ import annotations

import gc
import os

from shared.config import freeze_start_up_heap, set_openmp_wait_defaults


def test_openmp_wait_defaults_do_not_override_the_environment(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setenv("GOMP_SPINCOUNT", "7")
    set_openmp_wait_defaults()
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE" and os.environ["GOMP_SPINCOUNT"] == "7"


def test_the_start_up_heap_leaves_the_collectors_passes():
    built_at_start_up = [object() for _ in range(1000)]
    try:
        freeze_start_up_heap()
        assert gc.get_freeze_count() >= len(built_at_start_up)
    finally:
        gc.unfreeze()
