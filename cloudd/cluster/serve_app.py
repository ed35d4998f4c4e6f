"""The replicas as Ray Serve describes applications: an import path for ``serve build``, Serve's
config files and KubeRay's RayService.

- ``app``: the application of ``configs/cluster.toml``: ``serve build cloudd.cluster.serve_app:app
  -o serve.yaml`` writes Serve's config file for it (``configs/cluster-serve.yaml`` is one,
  generated so). Another TOML: point the file's ``import_path`` at ``build`` and give it ``args``.
- ``build``: Serve's application-builder form, for a config file's ``args`` (``config``: a
  cluster TOML) or ``serve run cloudd.cluster.serve_app:build config=configs/cluster.toml``.

Either deploys only the replicas, with the fleet router. The router's state lives in the
process that holds the handle, so robots still reach the cluster through ``cloudd cluster
serve``'s front (docs/cluster.md: which of the two deploys the application).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from cloudd.cluster.app import application
from cloudd.cluster.config import ClusterConfig
from shared.config import load_section

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "cluster.toml"


def build(args: dict[str, str]):
    """The replicas' application for ``args["config"]`` (a cluster TOML; default
    ``configs/cluster.toml``), with the engine flags left to that file, as ``cloudd cluster
    serve --config`` runs them."""
    from cloudd.assembly import ENGINE_ARGS, replica_args

    unknown = set(args) - {"config"}
    if unknown:
        raise ValueError(f"unknown application arguments {sorted(unknown)}: only 'config' (a cluster TOML)")
    config = Path(args.get("config") or DEFAULT_CONFIG)
    flags = argparse.Namespace(**{**{name: None for name in ENGINE_ARGS}, "config": config})
    return application(load_section(config, "cluster", ClusterConfig), replica_args(flags))


app = build({})
