"""`cloudd bench`'s modes refuse the flags they would ignore, before loading a model or starting a
server, and name each one."""

from __future__ import annotations

import pytest

from cloudd.__main__ import bench_flag_defaults, main
from cloudd.bench_modes import CLUSTER, IN_PROCESS, ONLINE, SERVE, bench_mode

MODES = (IN_PROCESS, SERVE, CLUSTER, ONLINE)


@pytest.mark.parametrize("argv, refused", [
    (["--online", "--baseline", "vllm", "--profile", "--index", "hashed"], "bench --online does not use --index, --profile"),
    (["--online", "--baseline", "vllm", "--serve", "tcp://127.0.0.1:9"], "bench --online does not use --serve"),
    (["--serve", "tcp://127.0.0.1:9", "--baseline", "hf"], "bench --serve does not use --baseline"),
    (["--serve", "tcp://127.0.0.1:9", "--config", "cloudd.toml", "--dtype", "float32"],
     "bench --serve does not use --config, --dtype"),
    (["--serve", "tcp://127.0.0.1:9", "--cluster"], "bench --serve does not use --cluster"),
    (["--cluster", "--tiers", "on"], "bench --cluster does not use --tiers"),
    (["--pairs", "3"], "bench (in-process replay) does not use --pairs"),
    (["--rate-scale", "2", "--request-rate", "8"], "does not use --rate-scale, --request-rate: leave them out"),
])
def test_a_flag_the_mode_would_ignore_is_an_error_naming_it(argv, refused, capsys):
    assert main(["bench", *argv]) == 2
    assert refused in capsys.readouterr().err


def test_a_flag_given_at_its_default_value_is_not_counted_as_given(capsys):
    # --index radix is the default: an online run with it is refused only for the missing baseline
    assert main(["bench", "--online", "--index", "radix"]) == 2
    assert "give --baseline vllm" in capsys.readouterr().err


def test_the_mode_is_online_then_serve_then_cluster_then_in_process():
    assert bench_mode(online=True, serve=True, cluster=True) is ONLINE
    assert bench_mode(online=False, serve=True, cluster=True) is SERVE
    assert bench_mode(online=False, serve=False, cluster=True) is CLUSTER
    assert bench_mode(online=False, serve=False, cluster=False) is IN_PROCESS


def test_every_mode_reads_limit_and_json_and_each_mode_its_own_switch():
    for mode, switch in [(ONLINE, "online"), (SERVE, "serve"), (CLUSTER, "cluster")]:
        assert {"limit", "json", switch} <= mode.reads
        assert not {"online", "serve", "cluster"} - {switch} & mode.reads
    assert not {"online", "serve", "cluster"} & IN_PROCESS.reads


def test_every_bench_flag_is_read_by_some_mode_and_every_mode_reads_only_bench_flags():
    flags = set(bench_flag_defaults())
    assert set().union(*(mode.reads for mode in MODES)) == flags  # a new flag no mode lists: refused everywhere
