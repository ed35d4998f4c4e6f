"""The fleet router's decisions (``cloudd.cluster.routing``), the prompt pages it judges by and
the autoscaling policy, without Ray."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from cloudd.cluster.autoscaling import FleetAutoscaling
from cloudd.cluster.prefix_pages import PAGE_CHARS, ReplicaPages, page_keys, routing_text
from cloudd.cluster.routing import ANY_REPLICA, FleetRouting, RouteHint, RoutingConfig

SYSTEM = "You plan tasks for a warehouse robot. " * 8
REPLICAS = ["a", "b", "c"]


def hint(rid: str, robot: str, text: str, priority: str = "plan") -> RouteHint:
    return RouteHint(rid, robot, priority, tuple(page_keys(routing_text([("system", SYSTEM), ("user", text)], ()))))


def send(router: FleetRouting, h: RouteHint, done: bool = True) -> str:
    """Route ``h`` as Ray would (first rank), and complete it unless ``done`` is False."""
    (chosen,), *_ = router.rank(REPLICAS, h)
    router.routed(h, chosen, f"ray-{h.request_id}")
    if done:
        router.completed(f"ray-{h.request_id}")
    return chosen


def test_a_robot_s_next_turn_goes_where_its_history_is():
    router = FleetRouting(RoutingConfig())
    router.set_replicas(REPLICAS)
    history = "scene: aisle 4, tote 12, shelf A3. " * 6
    first = {robot: send(router, hint(f"{robot}-1", robot, f"robot {robot} " + history)) for robot in "wxyz"}
    for robot in "wxyz":
        turn = send(router, hint(f"{robot}-2", robot, f"robot {robot} " + history + "then lift tote 12"))
        assert turn == first[robot]
    assert router.moves == 0 and router.snapshot()["decisions"]["prefix"] >= 4


def test_new_robots_spread_by_load_and_keep_their_replica_on_ties():
    router = FleetRouting(RoutingConfig())
    router.set_replicas(REPLICAS)
    placed = [send(router, hint(f"r{i}", f"robot{i}", "short"), done=False) for i in range(3)]
    assert sorted(placed) == REPLICAS  # in-flight counts, not Ray's queue cache, spread them
    again = send(router, hint("r0-b", "robot0", "short"))
    assert again == placed[0] and router.snapshot()["decisions"]["robot"] == 1


def test_an_imbalanced_fleet_falls_back_to_the_least_loaded_replica():
    router = FleetRouting(RoutingConfig(imbalance_abs=2, imbalance_rel=1.5))
    router.set_replicas(REPLICAS)
    text = "the same scene " * 20
    hot = send(router, hint("h0", "hot", text), done=False)
    for i in range(1, 3):  # in flight 3 : 0 : 0 is past both thresholds
        assert send(router, hint(f"h{i}", "hot", text), done=False) == hot
    moved = send(router, hint("h3", "hot", text), done=False)
    assert moved != hot and router.snapshot()["decisions"]["imbalance"] == 1


def test_safety_goes_to_the_replica_that_can_start_it_first():
    """It preempts wherever it lands: first where the least of its prompt is left to compute."""
    router = FleetRouting(RoutingConfig())
    router.set_replicas(REPLICAS)
    text = "the same scene " * 20
    home = send(router, hint("p0", "r", text), done=False)
    assert send(router, hint("s0", "r", text + "stop now", priority="safety"), done=False) == home
    newcomer = send(router, hint("s1", "new", "another scene " * 20, priority="safety"), done=False)
    assert newcomer != home  # nothing cached anywhere: the least loaded
    assert router.snapshot()["decisions"]["safety"] == 2 and router.moves == 0


def test_targets_reach_one_replica_or_any_and_are_not_counted():
    router = FleetRouting(RoutingConfig())
    router.set_replicas(REPLICAS)
    assert router.rank(REPLICAS, RouteHint("stats", target="b")) == [["b"]]
    assert router.rank(REPLICAS, RouteHint("stats", target="gone")) == []
    assert router.rank(REPLICAS, RouteHint("stats", target=ANY_REPLICA)) == [REPLICAS]
    router.routed(RouteHint("stats", target="b"), "b", "ray-1")
    assert router.snapshot()["replicas"]["b"]["routed"] == 0


def test_pow2_is_left_to_ray_and_every_rank_lists_every_candidate():
    assert FleetRouting(RoutingConfig(policy="pow2")).rank(REPLICAS, hint("x", "r", "t")) is None
    for policy in ("fleet", "hash"):
        ranks = FleetRouting(RoutingConfig(policy=policy)).rank(REPLICAS, hint("x", "r", "t"))
        assert sorted(c for rank in ranks for c in rank) == REPLICAS


def test_a_dead_replica_s_robots_and_requests_are_forgotten():
    router = FleetRouting(RoutingConfig())
    router.set_replicas(REPLICAS)
    where = send(router, hint("q", "robot", "scene " * 30), done=False)
    assert router.replica_of("q") == where
    router.set_replicas([r for r in REPLICAS if r != where])
    assert where not in router.snapshot()["replicas"] and "robot" not in router.last_replica
    router.completed("ray-q")
    assert router.replica_of("q") is None


@given(st.lists(st.sampled_from(["r1", "r2", "r3", "r4", "r5", "r6"]), min_size=1, max_size=60))
def test_the_hash_ring_keeps_robots_home_and_load_bounded(robots):
    router = FleetRouting(RoutingConfig(policy="hash", hash_load_factor=1.25))
    router.set_replicas(REPLICAS)
    alone = FleetRouting(RoutingConfig(policy="hash"))
    alone.set_replicas(REPLICAS)
    for i, robot in enumerate(robots):
        load_cap = -(-1.25 * (i + 1) // len(REPLICAS))
        chosen = send(router, hint(f"q{i}", robot, "t"), done=False)
        assert router.replicas[chosen].in_flight <= max(load_cap, 1)
        assert send(alone, hint(f"q{i}", robot, "t")) == send(alone, hint(f"q{i}b", robot, "t"))  # idle: home


@given(st.text(max_size=300), st.text(max_size=300))
def test_pages_match_exactly_the_shared_whole_pages(a, b):
    pages = ReplicaPages(capacity=1000)
    pages.insert(page_keys(a))
    shared = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    assert pages.match(page_keys(b)) == min(shared, len(a), len(b)) // PAGE_CHARS


def test_replica_pages_forget_the_least_recently_used_beyond_capacity():
    pages = ReplicaPages(capacity=2)
    first, second = page_keys("a" * 64), page_keys("b" * 64)
    pages.insert(first)
    pages.insert(second)
    pages.insert(first)
    pages.insert(page_keys("c" * 64))
    assert pages.match(first) == 1 and pages.match(second) == 0 and len(pages) == 2


def test_autoscaling_follows_queue_depth_and_kv_usage():
    policy = FleetAutoscaling(target_queue_depth=10, target_kv_usage=0.8)
    metrics = lambda queue, kv: {"queue_depth": dict(enumerate(queue)), "kv_usage": dict(enumerate(kv))}  # noqa: E731
    assert policy.desired(2, metrics([30, 20], [0.1, 0.1])) == 5
    assert policy.desired(2, metrics([0, 0], [0.9, 0.9])) == 3
    assert policy.desired(2, metrics([4, 4], [0.3, 0.3])) == 2  # one fewer would pass half the targets
    assert policy.desired(3, metrics([1, 0, 0], [0.1, 0.1, 0.1])) == 2
    assert policy.desired(0, {}) == 0


def test_a_burst_ranked_before_any_is_routed_still_spreads():
    router = FleetRouting(RoutingConfig())
    router.set_replicas(REPLICAS)
    firsts = [router.rank(REPLICAS, hint(f"b{i}", f"robot{i}", "short"))[0][0] for i in range(3)]
    assert sorted(firsts) == REPLICAS
    router.routed(hint("b0", "robot0", "short"), firsts[1], "ray-b0")  # Ray took another replica
    assert router.snapshot()["decisions"] == {"spill": 1}


def test_a_request_ranked_but_never_routed_stops_counting_as_load_once_it_ends():
    router = FleetRouting(RoutingConfig())
    router.set_replicas(REPLICAS)
    (chosen,), *_ = router.rank(REPLICAS, hint("lost", "robot0", "short"))  # Ray dropped it before routing
    assert router.rank(REPLICAS, hint("probe", "robot1", "short"))[0] != [chosen]  # it counts meanwhile
    router.forget("probe")
    router.forget("lost")
    assert router.rank(REPLICAS, hint("next", "robot2", "short"))[0] == [chosen]  # idle again: first by name
