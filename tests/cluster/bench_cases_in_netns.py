"""`cloudd bench --cluster`, run by ``test_cluster_process.py`` inside the loopback-only
namespace (after ``cases_in_netns.py`` has stopped its cluster): the JSON keys the issue's bar
reads, on a few requests of the bundled trace."""

from __future__ import annotations

import json
import tempfile

from cloudd.__main__ import main
from cloudd.trace import bundled_trace

RUN_KEYS = {"output_tok_s", "prefix_hit_rate", "ttft_s", "requests", "router"}


def test_cluster_bench_reports_each_router_and_one_replica_with_the_combined_pool(tmp_path, capsys):
    cfg = tmp_path / "cluster.toml"
    ray_dir = tempfile.mkdtemp(prefix="ray-", dir=tmp_path.parents[1])  # Ray's socket paths stay under 107 bytes
    cfg.write_text(f'[cluster]\nnum_cpus_per_replica = 0.5\nray_temp_dir = "{ray_dir}"\n'
                   '[engine]\ndtype = "float32"\ncompile = false\nnum_blocks = 512\n[serve]\nprecompile = []\n')
    args = ["bench", "--cluster", "--config", str(cfg), "--replicas", "2", "--router", "fleet,hash",
            "--trace", str(bundled_trace()), "--limit", "8", "--output-len", "2", "--rate-scale", "20", "--device-pool-frac", "0.5", "--json"]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result["runs"]) == {"fleet", "hash"} and result["replicas"] == 2
    for run in [*result["runs"].values(), result["single_replica"]]:
        assert RUN_KEYS <= set(run) and run["requests"] == 8 and not run["errors"]
    assert 0 < result["combined_pool_prefix_hit_rate"] == result["single_replica"]["prefix_hit_rate"] <= 1
    pool = result["pool"]
    assert pool["combined_blocks"] == 2 * pool["replica_blocks"] and pool["working_set_tokens"] > 0
    # the combined-pool replica carries one replica's load: the trace at half the routers' rate
    assert result["single_replica"]["rate_scale"] == 10 and all(r["rate_scale"] == 20 for r in result["runs"].values())
    assert set(result["predicted"]) >= {"random", "pow2", "robot", "combined"}
    for name, run in result["runs"].items():  # each run's own router, counting only its requests
        assert run["router"]["policy"] == name
        assert sum(r["routed"] for r in run["router"]["replicas"].values()) == 8
