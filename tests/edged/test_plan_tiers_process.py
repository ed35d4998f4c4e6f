"""``edged plan-eval --tiers hybrid`` end to end on loopback: the default model as the cloud (a
``cloudd serve`` the tool starts and stops) behind an edged front in this process whose policy
escalates every plan."""

from __future__ import annotations

import json

import pytest

from edged.escalation import EscalationConfig
from edged.plan_tiers import TierOptions, json_lines, run_tiers


@pytest.mark.parametrize("race", [False, True])
def test_the_hybrid_tier_answers_through_edged_and_its_escalations_through_the_cloud(default_model_path, tmp_path,
                                                                                     race):
    cloud_config = tmp_path / "cloudd.toml"
    cloud_config.write_text("[engine]\ncompile = false\n")  # start-up in seconds, not a minute
    # no plan is that sure: every one escalates, raced (the cloud's answer whoever finishes first) or not
    unsure = EscalationConfig(min_mean_logprob=0.0, race=race)
    options = TierOptions(tiers=("hybrid",), backend="torch", quant="none", cloud_model=default_model_path,
                          cloud_config=cloud_config, escalation=unsure)
    with json_lines(tmp_path / "records.jsonl") as record:
        report = run_tiers(default_model_path, options, limit=1, threads=1, log=None, record=record)
    hybrid = report["tiers"]["hybrid"]
    assert (hybrid["tasks"], hybrid["local_rate"], hybrid["valid_rate"], hybrid["grounded_rate"]) == (1, 0.0, 1.0, 1.0)
    rows = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert [(r["tier"], r["local"], r["valid"]) for r in rows] == [("hybrid", False, True)]
