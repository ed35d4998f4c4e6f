"""``python -m soak``'s phase and kind selection (parsing only: nothing is started)."""

from __future__ import annotations

import argparse

import pytest

from soak.__main__ import _names, main
from soak.attacks import ATTACKS
from soak.run import PHASES


def test_a_comma_list_of_known_names_is_kept_in_order():
    parser = argparse.ArgumentParser()
    assert _names(parser, "hostile", PHASES, "phases") == ("hostile",)
    assert _names(parser, "frame_flood,http_slowloris", ATTACKS, "attack kinds") == ("frame_flood", "http_slowloris")


@pytest.mark.parametrize("argv", [["--only", "hostile,nap"], ["--hostile-kinds", "frame_flood,typo"]])
def test_an_unknown_phase_or_attack_kind_is_a_usage_error_before_anything_starts(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and "unknown" in capsys.readouterr().err


def test_the_phase_has_at_least_ten_attack_kinds_in_snake_case():
    assert len(ATTACKS) >= 10 and all(name.isidentifier() and name.islower() for name in ATTACKS)
