"""fleetctl, the operator's CLI: what a running cloudd is doing, from its ``stats`` reply.

Views: ``status`` (one summary), ``top`` (the summary plus the running batch and the slowest
robots, redrawn every ``--interval``), ``robots`` and ``requests``. With ``--json`` each prints
its part of the snapshot instead (the shape is documented in ``cloudd.monitor``).

The builders below take a snapshot dict and return rich renderables, so they need no server;
``main`` is the only part that talks to the daemon. Every value may be None (no data yet):
it shows as "-". Tables fit an 80-column terminal; long ids are cut with an ellipsis.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import zmq
from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.panel import Panel
from rich.table import Column, Table
from rich.text import Text

from shared.model.summary import describe
from shared.transport.client import ClientConfig, FleetClient, RequestFailed
from shared.transport.curve import ClientCurve

Snapshot = dict[str, Any]

DEFAULT_ENDPOINT = "tcp://127.0.0.1:5555"
DEFAULT_TIMEOUT_S = 15.0  # a stats reply waits for the engine step in progress
TOP_RUNNING_ROWS = 8  # rows of the running batch in `top`
TOP_ROBOT_ROWS = 5  # slowest robots in `top`
STATE_STYLE = {"ok": "green", "draining": "yellow"}


# --- formatting ---------------------------------------------------------------------------------


def fmt(value: object, spec: str = "") -> str:
    """``value`` formatted with ``spec`` (``format()`` syntax); "-" for None or ""."""
    return "-" if value is None or value == "" else format(value, spec)


def fmt_seconds(seconds: float | None) -> str:
    """A duration for humans: "-" for None; under 1 s in ms and under a minute in s (3 significant
    digits, at most 7 characters); longer ones as 1m05s, 2h03m, 3d04h."""
    if seconds is None:
        return "-"
    if seconds < 1:
        return f"{_three_digits(seconds * 1000)} ms"
    if seconds < 60:
        return f"{_three_digits(seconds)} s"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    if days:
        return f"{days}d{hours:02d}h"
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def _three_digits(x: float) -> str:
    return f"{x:.0f}" if x >= 99.95 else f"{x:.1f}" if x >= 9.995 else f"{x:.2f}"


def fmt_p50_p99(percentiles: dict[str, float | None] | None) -> str:
    """A latency's ``{"p50", "p99"}`` (seconds) as "p50 1.20 ms · p99 3.40 ms"."""
    p = percentiles or {}
    return f"p50 {fmt_seconds(p.get('p50'))} · p99 {fmt_seconds(p.get('p99'))}"


# --- tables -------------------------------------------------------------------------------------


def _id_column(header: str, max_width: int) -> Column:
    """A column of names (robot, request, class): left-aligned, cut to ``max_width`` with "…"."""
    return Column(header, max_width=max_width, no_wrap=True, overflow="ellipsis")


def _number_column(header: str) -> Column:
    return Column(header, justify="right", no_wrap=True)


def _table(title: str, columns: Sequence[Column], rows: Sequence[Sequence[str]], total: int) -> Table:
    """A compact table of ``rows`` (plain text: never read as rich markup) out of ``total``;
    the caption says "none" for an empty table and how many rows were left out."""
    caption = "none" if total == 0 else f"… {total - len(rows)} more" if len(rows) < total else None
    table = Table(*columns, title=title, caption=caption, box=box.SIMPLE_HEAD, show_edge=False,
                  padding=(0, 1, 0, 0), title_justify="left", title_style="bold", caption_justify="left")
    for row in rows:
        table.add_row(*map(Text, row))
    return table


def classes_table(snap: Snapshot) -> Table:
    """Per request class (most urgent first): live queue and TTFT/TPOT percentiles over the
    recent window ("recent" counts that window's finished requests)."""
    by_priority = snap.get("by_priority") or {}
    rows = []
    for name, queue in (snap.get("queue") or {}).items():
        stats = by_priority.get(name) or {}
        ttft, tpot = stats.get("ttft_s") or {}, stats.get("tpot_s") or {}
        rows.append([name, fmt(queue.get("waiting")), fmt(queue.get("running")), fmt(stats.get("requests", 0)),
                     fmt_seconds(ttft.get("p50")), fmt_seconds(ttft.get("p99")),
                     fmt_seconds(tpot.get("p50")), fmt_seconds(tpot.get("p99"))])
    columns = [_id_column("class", 11), _number_column("waiting"), _number_column("running"),
               _number_column("recent"), _number_column("TTFT p50"), _number_column("TTFT p99"),
               _number_column("TPOT p50"), _number_column("TPOT p99")]
    return _table("classes", columns, rows, len(rows))


def robots_table(snap: Snapshot, limit: int | None = None) -> Table:
    """The robots, slowest (p99 TTFT) first as the snapshot orders them; at most ``limit``."""
    robots = snap.get("robots") or []
    rows = [[fmt(r.get("robot_id")), fmt(r.get("requests")), fmt(r.get("live")), fmt(r.get("output_tokens"), ","),
             fmt_seconds(r.get("ttft_p50_s")), fmt_seconds(r.get("ttft_p99_s")), fmt_seconds(r.get("last_seen_s"))]
            for r in robots[:limit]]
    columns = [_id_column("robot", 20), _number_column("requests"), _number_column("live"),
               _number_column("out tok"), _number_column("TTFT p50"), _number_column("TTFT p99"),
               _number_column("last seen")]
    title = "slowest robots" if limit is not None else f"robots ({len(robots)})"
    return _table(title, columns, rows, len(robots))


def running_table(snap: Snapshot, limit: int | None = None) -> Table:
    """Live requests (waiting or running), oldest first; at most ``limit``."""
    live = snap.get("running") or []
    rows = [[fmt(r.get("request_id")), fmt(r.get("robot_id")), fmt(r.get("priority")), fmt(r.get("state")),
             fmt(r.get("prompt_tokens")), fmt(r.get("output_tokens")), fmt_seconds(r.get("age_s"))]
            for r in live[:limit]]
    columns = [_id_column("request", 14), _id_column("robot", 12), _id_column("class", 11),
               _id_column("state", 7), _number_column("prompt"), _number_column("out"), _number_column("age")]
    return _table(f"live requests ({len(live)})", columns, rows, len(live))


def recent_table(snap: Snapshot) -> Table:
    """Finished requests, newest first, with their latencies."""
    recent = snap.get("recent") or []
    rows = [[fmt(r.get("request_id")), fmt(r.get("robot_id")), fmt(r.get("priority")), fmt(r.get("finish_reason")),
             fmt(r.get("output_tokens")), fmt_seconds(r.get("ttft_s")), fmt_seconds(r.get("tpot_s")),
             fmt_seconds(r.get("e2e_s"))]
            for r in recent]
    columns = [_id_column("request", 12), _id_column("robot", 10), _id_column("class", 11),
               _id_column("finish", 8), _number_column("out"), _number_column("TTFT"), _number_column("TPOT"),
               _number_column("E2E")]
    return _table(f"recent requests ({len(recent)})", columns, rows, len(recent))


# --- views --------------------------------------------------------------------------------------


def replicas_table(snap: Snapshot) -> Table:
    """A cluster's replicas (``cloudd cluster serve``): load, KV, cache hits, and what the router
    sent each; the router's decisions in the caption."""
    cluster = snap.get("cluster") or {}
    rows = [[fmt(r.get("replica")), fmt(r.get("pid")), fmt(r.get("running")), fmt(r.get("waiting")),
             f"{fmt(r.get('kv_blocks_used'))}/{fmt(r.get('kv_blocks_total'))}", fmt(r.get("prefix_hit_rate"), ".1%"),
             fmt(r.get("output_tok_s"), ".1f"), fmt(r.get("routed")), fmt(r.get("prefix_hits"))]
            for r in cluster.get("replicas") or []]
    table = _table("replicas", [_id_column("replica", 24), _number_column("pid"), _number_column("running"),
                                _number_column("waiting"), _number_column("KV blocks"), _number_column("prefix hits"),
                                _number_column("tok/s"), _number_column("routed"), _number_column("routed to its prefix")],
                   rows, len(rows))
    router = cluster.get("router") or {}
    decisions = " · ".join(f"{k} {v}" for k, v in sorted((router.get("decisions") or {}).items())) or "none yet"
    table.caption = (f"router {fmt(router.get('policy'))}: {decisions} · robots moved {fmt(router.get('moves'))}"
                     f" · requests resumed after a replica died {fmt(cluster.get('resumed'))}")
    return table


def _summary_lines(snap: Snapshot) -> list[tuple[str, str]]:
    """(label, value) lines of the status panel."""
    tp, eng, lat, tot = (snap.get(k) or {} for k in ("throughput", "engine", "latency", "totals"))
    used, total = eng.get("kv_blocks_used"), eng.get("kv_blocks_total")
    kv_share = used / total if used is not None and total else None
    return [
        ("model", describe(snap.get("model_arch"), snap.get("model_params"))),
        ("throughput", f"{fmt(tp.get('output_tok_s'), '.1f')} tok/s · {fmt(tp.get('requests_per_s'), '.2f')} req/s"
                       f" (last {fmt_seconds(tp.get('window_s'))})"),
        ("batch", f"{fmt(eng.get('running'))} running · {fmt(eng.get('waiting'))} waiting"
                  f" · {fmt(eng.get('preemptions'))} preemptions · {fmt(eng.get('steps'), ',')} steps"
                  f" · {eng.get('dtype') or '-'}"),
        ("KV cache", f"{fmt(used)}/{fmt(total)} blocks ({fmt(kv_share, '.1%')})"
                     f" · {fmt(eng.get('kv_blocks_in_requests'))} in requests"
                     f" · prefix hits {fmt(eng.get('prefix_hit_rate'), '.1%')}"),
        *_tier_lines(snap.get("tiers")),
        ("TTFT", fmt_p50_p99(lat.get("ttft_s"))),
        ("TPOT", fmt_p50_p99(lat.get("tpot_s"))),
        ("E2E", fmt_p50_p99(lat.get("e2e_s"))),
        ("queue wait", fmt_p50_p99(lat.get("queue_s"))),
        ("requests", f"{fmt(tot.get('requests'))} admitted · {fmt(tot.get('completed'))} completed"
                     f" · {fmt(tot.get('rejected'))} rejected · {fmt(tot.get('cancelled'))} cancelled"
                     f" · {fmt(tot.get('error'))} failed"),
        ("deadlines", f"{fmt(tot.get('deadline'))} requests ended by their deadline"),
        ("output", f"{fmt(tot.get('output_tokens'), ',')} tokens"),
    ]


def _tier_lines(tiers: dict | None) -> list[tuple[str, str]]:
    """HiCache's line of the status panel: hits per tier, traffic, load latency (none when off)."""
    if not tiers:
        return []
    hits, moved = tiers.get("hit_tokens") or {}, tiers.get("bytes_moved") or {}
    mb = {k: fmt((v or 0) / 2**20, ",.0f") for k, v in moved.items()}
    return [("KV tiers", f"hits device {fmt(hits.get('device'), ',')} · host {fmt(hits.get('host'), ',')}"
                         f" · disk {fmt(hits.get('disk'), ',')} tokens · {fmt(tiers.get('loading'))} loading"
                         f" · {fmt(tiers.get('loads'), ',')} loads ({fmt(tiers.get('loads_layerwise'), ',')}"
                         f" layer by layer), {fmt_seconds(tiers.get('load_mean_s'))} avg"
                         f" · host {fmt(tiers.get('host_pages_used'), ',')}/{fmt(tiers.get('host_pages_total'), ',')}"
                         f" pages · disk {fmt(tiers.get('disk_pages'), ',')} pages"),
            ("tier traffic", f"D→H {mb.get('device_to_host', '-')} MB · H→D {mb.get('host_to_device', '-')} MB"
                             f" · H→disk {mb.get('host_to_disk', '-')} MB · disk→H {mb.get('disk_to_host', '-')} MB")]


def status_panel(snap: Snapshot) -> RenderableType:
    """``fleetctl status``: model, policy, state and uptime in the title; the model's
    architecture and parameter count, throughput, batch, KV use and prefix-cache hit rate,
    fleet-wide latency percentiles and totals; a cluster's replicas and router; then the
    classes table."""
    state = snap.get("state") or "-"
    title = Text.assemble(("cloudd ", "bold"), (fmt(snap.get("model")), "bold cyan"),
                          f" ({fmt(snap.get('policy'))} policy) · ",
                          (state, STATE_STYLE.get(state, "red")), f" · up {fmt_seconds(snap.get('uptime_s'))}")
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column()
    for label, value in _summary_lines(snap):
        grid.add_row(label, value)
    cluster = [replicas_table(snap)] if snap.get("cluster") else []
    return Group(Panel(grid, title=title, title_align="left", box=box.ROUNDED), *cluster, classes_table(snap))


def requests_view(snap: Snapshot) -> RenderableType:
    """``fleetctl requests``: the live requests, then the recently finished ones."""
    return Group(running_table(snap), Text(), recent_table(snap))


def top_view(snap: Snapshot) -> RenderableType:
    """One frame of ``fleetctl top``: the status panel, the running batch (first rows) and the
    slowest robots."""
    return Group(status_panel(snap), running_table(snap, TOP_RUNNING_ROWS), robots_table(snap, TOP_ROBOT_ROWS))


def run_top(frame: Callable[[], RenderableType], console: Console, interval_s: float,
            iterations: int | None) -> None:
    """Redraw what ``frame()`` returns every ``interval_s`` until ``iterations`` frames have been
    shown (None: until Ctrl-C, which ends it quietly). ``frame``'s errors propagate."""
    frames: Iterable[int] = itertools.count() if iterations is None else range(iterations)
    try:
        with Live(console=console, auto_refresh=False) as live:
            for n in frames:
                if n:
                    time.sleep(interval_s)
                live.update(frame(), refresh=True)
    except KeyboardInterrupt:
        pass


@dataclass(frozen=True)
class View:
    """A subcommand: how to draw the snapshot, and what of it ``--json`` prints."""

    render: Callable[[Snapshot], RenderableType]
    json_part: Callable[[Snapshot], Any]


VIEWS: dict[str, View] = {
    "status": View(status_panel, lambda snap: snap),
    "top": View(top_view, lambda snap: snap),
    "robots": View(robots_table, lambda snap: snap.get("robots") or []),
    "requests": View(requests_view, lambda snap: {"running": snap.get("running") or [],
                                                   "recent": snap.get("recent") or []}),
}


# --- command line -------------------------------------------------------------------------------


def _endpoint(text: str) -> str:
    """argparse type: an address a ZeroMQ socket accepts (checked locally; nothing is sent)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    try:
        sock.connect(text)
    except zmq.ZMQError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not a ZeroMQ endpoint ({e.strerror})") from None
    finally:
        sock.close(linger=0)
    return text


def _positive(kind: Callable[[str], float | int]) -> Callable[[str], float | int]:
    """argparse type: ``kind(text)``, which must be a finite number above 0."""

    def parse(text: str) -> float | int:
        try:
            value = kind(text)
        except ValueError:
            value = 0
        if not 0 < value < float("inf"):
            raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    """The subcommands, each with ``--endpoint``, ``--timeout`` and ``--json``."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--endpoint", type=_endpoint, default=DEFAULT_ENDPOINT,
                        help=f"cloudd's ZeroMQ endpoint (default {DEFAULT_ENDPOINT})")
    common.add_argument("--timeout", type=_positive(float), default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                        help=f"give up on a silent daemon after this long (default {DEFAULT_TIMEOUT_S:g})")
    common.add_argument("--json", action="store_true", help="print the snapshot's JSON instead")
    common.add_argument("--server-key", metavar="FILE", help="cloudd's public key (.key), for a CURVE daemon")
    common.add_argument("--key", metavar="FILE", help="this operator's key pair (.key_secret), authorized by cloudd")
    parser = argparse.ArgumentParser(prog="fleetctl", description="Watch a running cloudd.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{status,top,robots,requests}")
    commands.add_parser("status", parents=[common], help="model, throughput, engine, latency, totals")
    top = commands.add_parser("top", parents=[common], help="live view, redrawn until Ctrl-C "
                                                          "(with --json: one snapshot)")
    top.add_argument("--interval", type=_positive(float), default=1.0, metavar="SECONDS",
                     help="time between refreshes (default 1)")
    top.add_argument("--iterations", type=_positive(int), metavar="N", help="stop after N refreshes")
    commands.add_parser("robots", parents=[common], help="per-robot traffic, slowest first")
    commands.add_parser("requests", parents=[common], help="live and recently finished requests")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one fleetctl command; 0 on success, 1 when the daemon does not answer or answers
    with an error (one line on stderr) or stdout is closed early, 130 when interrupted;
    argparse exits 2 on bad usage."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if bool(args.server_key) != bool(args.key):
        parser.error("--server-key and --key go together")
    view = VIEWS[args.command]
    try:
        curve = ClientCurve.from_files(args.server_key, args.key) if args.server_key else None
        with FleetClient(args.endpoint, ClientConfig(timeout_s=args.timeout, retries=0, curve=curve)) as client:
            fetch = functools.partial(client.stats, args.timeout)
            if args.json:
                print(json.dumps(view.json_part(fetch()), indent=2))
            elif args.command == "top":
                run_top(lambda: view.render(fetch()), Console(), args.interval, args.iterations)
            else:
                Console().print(view.render(fetch()))
    except TimeoutError:
        return _fail(f"no answer from {args.endpoint} within {args.timeout:g} s — is cloudd running?")
    except RequestFailed as e:
        return _fail(f"{args.endpoint} answered with an error: {e}")
    except (OSError, ValueError) as e:  # an unreadable or wrong CURVE key file
        return _fail(f"CURVE keys: {e}")
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # stdout closed early (`fleetctl requests --json | head`)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit flush is quiet
        return 1
    return 0


def _fail(message: str) -> int:
    print(f"fleetctl: {message}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
