"""Ray Serve's own config file for the cluster's replicas: ``serve build`` writes it from
``cloudd.cluster.serve_app:app`` (no Ray instance needed), and ``configs/cluster-serve.yaml`` is
that output with its two documented edits."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from cloudd.cluster.config import ClusterConfig
from shared.config import load_section

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("ray.serve")


def serve_build(tmp_path: Path) -> dict:
    out = tmp_path / "serve.yaml"
    proc = subprocess.run([str(Path(sys.executable).with_name("serve")), "build", "cloudd.cluster.serve_app:app",
                           "-o", str(out)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return yaml.safe_load(out.read_text())


def test_serve_build_describes_the_replicas_of_the_cluster_config(tmp_path):
    built = serve_build(tmp_path)
    (app,) = built["applications"]
    (deployment,) = app["deployments"]
    cluster = load_section(ROOT / "configs" / "cluster.toml", "cluster", ClusterConfig)
    assert app["import_path"] == "cloudd.cluster.serve_app:app"
    assert deployment["name"] == "EngineReplica" and deployment["num_replicas"] == cluster.replicas
    assert deployment["ray_actor_options"]["num_cpus"] == cluster.num_cpus_per_replica
    router = deployment["request_router_config"]
    assert router["request_router_class"] == "cloudd.cluster.ray_router.FleetRequestRouter"
    assert router["request_router_kwargs"]["policy"] == cluster.router

    committed = yaml.safe_load((ROOT / "configs" / "cluster-serve.yaml").read_text())
    assert committed["proxy_location"] == "Disabled" and committed["applications"][0]["name"] == "cloudd"
    edited = {**built, "proxy_location": "Disabled", "applications": [{**app, "name": "cloudd"}]}
    assert committed == edited  # regenerate it (docs/cluster.md) when configs/cluster.toml changes


def test_the_application_builder_takes_a_cluster_toml_and_refuses_other_arguments(tmp_path):
    from cloudd.cluster.serve_app import build

    cfg = tmp_path / "cluster.toml"
    cfg.write_text("[cluster]\nreplicas = 3\nrouter = \"hash\"\n")
    app = build({"config": str(cfg)})
    assert app._bound_deployment.num_replicas == 3
    with pytest.raises(ValueError, match="only 'config'"):
        build({"config": str(cfg), "replicas": "4"})
