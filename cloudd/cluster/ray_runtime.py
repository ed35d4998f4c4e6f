"""Ray for cloudd's cluster: import it (or say how to install it), start a local instance that
talks only to loopback, or join an existing cluster.

A local instance (``address = ""``) follows ``../shared/reference/ray-serve-notes.md``: usage
statistics off; ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` so that 127.0.0.1 is not swapped for the
main interface's address; outbound HTTP sent to a closed loopback proxy, which stops the
usage-stats process's probe of cloud-metadata addresses; no dashboard; Serve's HTTP proxy off
(the front process serves HTTP). One exposure remains that no setting moves: every Serve
replica opens an idle gRPC listener on all interfaces. Where that matters, run the cluster in a
network namespace that has only loopback (``unshare -n``), as the tests and benches do.
"""

from __future__ import annotations

import os
from types import ModuleType

from cloudd.cluster.config import ClusterConfig

APP_NAME = "cloudd"  # the Serve application `cloudd cluster serve` deploys
RAY_VERSION = "2.60.0"  # the request-router API is alpha: pinned to what was verified
INSTALL_HINT = ("cloudd cluster needs Ray Serve: pip install -e '.[cluster]' (ray[serve]==" + RAY_VERSION + ")")
LOOPBACK_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "HTTP_PROXY": "http://127.0.0.1:9",
    "HTTPS_PROXY": "http://127.0.0.1:9",
    "NO_PROXY": "localhost,127.0.0.1,::1",
    "RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S": "1.0",  # 0.1 s floods a busy 2-core log
}


class ClusterUnavailable(RuntimeError):
    """Ray is not installed, or is not the pinned version."""


def import_ray() -> tuple[ModuleType, ModuleType]:
    """``(ray, ray.serve)``; ClusterUnavailable naming the install command when missing."""
    try:
        import ray
        from ray import serve
    except ImportError as e:
        raise ClusterUnavailable(f"{INSTALL_HINT} ({e})") from None
    if ray.__version__ != RAY_VERSION:
        raise ClusterUnavailable(f"Ray {ray.__version__} is installed; {INSTALL_HINT}")
    return ray, serve


def start_ray(config: ClusterConfig) -> bool:
    """Start (``address = ""``) or join Ray, then Serve without its HTTP proxy. Returns True
    when this process started the instance (and so must stop it)."""
    ray, serve = import_ray()
    local = not config.address
    if local:
        os.environ.update(LOOPBACK_ENV)  # NOTE: before ray.init: its processes inherit it
        ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=config.ray_num_cpus or os.cpu_count(),
                 _temp_dir=config.ray_temp_dir or "/tmp/fleetserve-ray", log_to_driver=False,
                 logging_level="WARNING", configure_logging=False)
    else:
        ray.init(address=config.address, log_to_driver=False, logging_level="WARNING")
    serve.start(proxy_location="Disabled")
    return local


def stop_ray(started_here: bool) -> None:
    """Remove cloudd's Serve application; stop Ray too when this process started it (a joined
    cluster keeps running)."""
    ray, serve = import_ray()
    if started_here:
        serve.shutdown()
        ray.shutdown()
    else:
        serve.delete(APP_NAME)
        ray.shutdown()
