"""``fleetserve_ros``: a ROS 2 managed (lifecycle) node that plans robot tasks with a fleetserve
daemon (edged on the robot, or cloudd) through ``robot_sdk.PlanClient``.

Interfaces (types from ``fleetserve_interfaces``, built by ``ros/build_interfaces.sh``):

- action ``~/plan`` (``Plan``): goal task, scene JSON, skill-set id or raw JSON schema, priority,
  deadline, escalation, max_tokens; feedback per finished plan step (all steps so far and where
  the plan runs); result a ``PlanResult``. Canceling a goal cancels the request at the daemon
  (``PlanClient.cancel_nowait``), which stops generation. A goal is checked when it arrives: an
  invalid one (a bad field, an unknown skill set, skills that name scene places with no scene,
  ``max_tokens`` too small for one step) is rejected, as are goals while inactive or beyond
  ``max_concurrent_goals`` running plans; nothing is sent to the daemon for them.
- topic ``~/goal_rejections`` (``diagnostic_msgs/DiagnosticStatus``, reliable, transient_local,
  depth ``plans_history``): why each goal was rejected, since a ROS 2 action rejection carries
  no reason. ``name`` "<node>: goal rejected", ``message`` the reason (also logged as a
  warning), ``values`` the goal's task, skills, priority, escalation, max_tokens and deadline_ms,
  by which a client finds its own.
- service ``~/get_plan`` (``GetPlan``): one plan, no feedback; counts against the same limit
  (over it the answer is ``ok`` false, "busy").
- topic ``/plans`` (``PlanResult``, reliable, transient_local, depth ``plans_history``): every
  result, successes and failures, from either interface.
- topic ``/diagnostics`` (``diagnostic_msgs/DiagnosticArray``) every ``diagnostics_period_s``
  while active: endpoint reachable (a health probe), daemon status, last latency, counters.

Lifecycle: rclpy's own ``LifecycleNode`` (``rclpy.lifecycle``, present in the rclpy 9 wheels), so
the standard ``~/change_state``/``~/get_state`` services drive it. ``configure`` reads the
parameters, loads the skill sets and connects; ``activate`` starts accepting goals and
publishing diagnostics; ``deactivate`` cancels running plans and stops accepting;
``cleanup``/``shutdown`` close the connection. ``python -m robot_sdk.ros`` configures and
activates at start unless ``autostart`` is false.

Threads: run it on a MultiThreadedExecutor with at least ``max_concurrent_goals + 3`` threads
(plans block one thread each; cancels, the probe and lifecycle requests need the rest). The
events executor is not usable: it loses service replies with these wheels.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from typing import Any

from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from fleetserve_interfaces.action import Plan as PlanAction
from fleetserve_interfaces.msg import PlanResult
from fleetserve_interfaces.srv import GetPlan
from rclpy.action import ActionServer, CancelResponse, GoalResponse
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup, ReentrantCallbackGroup
from rclpy.lifecycle import LifecycleNode, LifecycleState, TransitionCallbackReturn
from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy

from robot_sdk import PlanClient, PlanDone, PlanError, PlanStepEvent, PlanText
from robot_sdk.ros.plan_request import PlanArgs, PlanDefaults, plan_args
from robot_sdk.ros.skill_sets import load_skill_sets
from robot_sdk.ros.status import EndpointStatus, Level
from shared.transport.local_socket import EDGED_ENDPOINT

NODE_NAME = "fleetserve_ros"
PARAMETERS: dict[str, Any] = {
    "endpoint": EDGED_ENDPOINT,  # edged's default socket (the node runs as the robot's user), or cloudd's
    "endpoint_tier": "",  # "edge" | "cloud" | "": lets feedback say where a plan runs before it is done
    "robot_id": "",  # sent with every request ("" = the node's name)
    "timeout_s": 30.0,  # PlanClient: a silent daemon is re-sent the request after this long
    "retries": 3,
    "max_concurrent_goals": 2,
    "skill_sets_file": "",  # JSON {id: [skill, ...]} added to the built-in fleet/amr/manipulator
    "default_skills": "fleet",
    "default_priority": "plan",
    "default_deadline_ms": 0,
    "default_escalation": "auto",
    "max_tokens": 0,  # a goal's default; 0: room for max_steps (8) complete steps of its skills in its scene
    "max_max_tokens": 2048,  # the most a goal may ask for (a derived default is not capped)
    "max_task_chars": 2000,
    "max_scene_chars": 16000,
    "diagnostics_period_s": 1.0,
    "health_timeout_s": 1.0,
    "plans_history": 10,
    "autostart": True,  # read by __main__ only
}
SUCCESS, FAILURE = TransitionCallbackReturn.SUCCESS, TransitionCallbackReturn.FAILURE


class FleetServeNode(LifecycleNode):
    """The node; see the module docstring. ``max_goal_threads`` caps ``max_concurrent_goals``
    to what the executor it runs on can serve (configure fails above it)."""

    def __init__(self, name: str = NODE_NAME, max_goal_threads: int | None = None, **kwargs: Any):
        super().__init__(name, **kwargs)
        for key, default in PARAMETERS.items():
            self.declare_parameter(key, default)
        self.max_goal_threads = max_goal_threads
        self._lock = threading.Lock()
        self._active = False
        self._running: set[str] = set()  # request ids of plans in flight
        self._canceling: set[str] = set()  # request ids of goals whose cancel was accepted
        self._reserved = 0  # slots taken: accepted goals and service calls not yet finished
        self._client: PlanClient | None = None
        self._probe: PlanClient | None = None
        self._entities: list[Any] = []
        self._timer = None
        self.status: EndpointStatus | None = None

    # --- lifecycle ------------------------------------------------------------------------

    def on_configure(self, state: LifecycleState) -> TransitionCallbackReturn:
        p = {key: self.get_parameter(key).value for key in PARAMETERS}
        try:
            self._configure(p)
        except ValueError as e:
            self.get_logger().error(f"configure failed: {e}")
            self._close()
            return FAILURE
        self.get_logger().info(f"configured: endpoint={self.endpoint} skill sets={sorted(self._skill_sets)}")
        return SUCCESS

    def _check(self, p: dict[str, Any]) -> None:
        """Raise ValueError naming the first out-of-range parameter (PlanDefaults checks the rest)."""
        if not p["endpoint"].startswith(("tcp://", "ipc://")):
            raise ValueError(f"endpoint: {p['endpoint']!r} is not a tcp:// or ipc:// ZeroMQ address")
        if p["endpoint_tier"] not in ("", "edge", "cloud"):
            raise ValueError(f"endpoint_tier: {p['endpoint_tier']!r} is not one of '', 'edge', 'cloud'")
        cap = self.max_goal_threads
        if p["max_concurrent_goals"] < 1 or (cap is not None and p["max_concurrent_goals"] > cap):
            raise ValueError(f"max_concurrent_goals: {p['max_concurrent_goals']} is out of range "
                             f"[1, {cap or 'inf'}] for this executor")
        if p["diagnostics_period_s"] <= 0 or p["health_timeout_s"] <= 0 or p["plans_history"] < 1:
            raise ValueError("diagnostics_period_s, health_timeout_s and plans_history must be > 0")
        if p["timeout_s"] <= 0 or p["retries"] < 0:
            raise ValueError("timeout_s must be > 0 and retries >= 0")

    def _configure(self, p: dict[str, Any]) -> None:
        """Everything configure builds; raises ValueError (nothing is left half-built but the
        clients, which on_configure closes)."""
        self._check(p)
        self._skill_sets = load_skill_sets(p["skill_sets_file"])
        self._defaults = PlanDefaults(p["default_skills"], p["default_priority"], p["default_deadline_ms"],
                                      p["default_escalation"], p["max_tokens"], p["max_max_tokens"],
                                      p["max_task_chars"], p["max_scene_chars"])
        self._defaults.check(self._skill_sets)
        self.endpoint, self._tier, self._max_goals = p["endpoint"], p["endpoint_tier"], p["max_concurrent_goals"]
        self._period_s, self._health_timeout_s = p["diagnostics_period_s"], p["health_timeout_s"]
        self._robot_id = p["robot_id"] or self.get_name()
        self._client = PlanClient(self.endpoint, robot_id=self._robot_id, timeout_s=p["timeout_s"],
                                  retries=p["retries"])
        self._probe = PlanClient(self.endpoint, robot_id=self._robot_id, timeout_s=self._health_timeout_s, retries=0)
        self.status = EndpointStatus(self.endpoint)
        plans_qos = QoSProfile(depth=p["plans_history"], history=HistoryPolicy.KEEP_LAST,
                               reliability=ReliabilityPolicy.RELIABLE, durability=DurabilityPolicy.TRANSIENT_LOCAL)
        work = ReentrantCallbackGroup()
        self._plans_pub = self.create_publisher(PlanResult, "/plans", plans_qos)
        self._diag_pub = self.create_publisher(DiagnosticArray, "/diagnostics", 10)
        self._rejections_pub = self.create_publisher(DiagnosticStatus, "~/goal_rejections", plans_qos)
        self._action = ActionServer(self, PlanAction, "~/plan", execute_callback=self._execute,
                                    goal_callback=self._on_goal, cancel_callback=self._on_cancel,
                                    callback_group=work)
        self._service = self.create_service(GetPlan, "~/get_plan", self._get_plan, callback_group=work)
        self._entities = [self._plans_pub, self._diag_pub, self._rejections_pub, self._action, self._service]

    def on_activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._timer = self.create_timer(self._period_s, self._publish_diagnostics,
                                        callback_group=MutuallyExclusiveCallbackGroup())
        with self._lock:
            self._active = True
        self.get_logger().info("active")
        return SUCCESS

    def on_deactivate(self, state: LifecycleState) -> TransitionCallbackReturn:
        with self._lock:
            self._active = False
            running = list(self._running)
        for rid in running:  # their goals end aborted, "Cancelled"
            self._client.cancel_nowait(rid)
        if self._timer is not None:
            self.destroy_timer(self._timer)
            self._timer = None
        return SUCCESS

    def on_cleanup(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._close()
        return SUCCESS

    def on_shutdown(self, state: LifecycleState) -> TransitionCallbackReturn:
        self.stop()
        self._close()
        return SUCCESS

    def stop(self) -> None:
        """Stop accepting, cancel the running plans at the daemon, close the connections
        (for a process exit, where the ROS context may already be shut down)."""
        with self._lock:
            self._active = False
            running = list(self._running)
        for rid in running:
            self._client.cancel_nowait(rid)
        for client in (self._client, self._probe):
            if client is not None:
                client.close()

    def _close(self) -> None:
        """Destroy what configure created; a no-op when nothing was."""
        if self._entities:
            *publishers, action, service = self._entities
            action.destroy()
            self.destroy_service(service)
            for publisher in publishers:
                self.destroy_publisher(publisher)
            self._entities = []
        for client in (self._client, self._probe):
            if client is not None:
                client.close()
        self._client = self._probe = None

    # --- slots (bounded concurrency) -----------------------------------------------------------

    def _reserve(self) -> bool:
        with self._lock:
            if not self._active or self._reserved >= self._max_goals:
                return False
            self._reserved += 1
            return True

    def _release(self) -> None:
        with self._lock:
            self._reserved -= 1

    @property
    def active_plans(self) -> int:
        with self._lock:
            return self._reserved

    # --- the Plan action -------------------------------------------------------------------------

    def _on_goal(self, goal: PlanAction.Goal) -> GoalResponse:
        """Accept a goal only if it can run: its fields checked (``plan_args``), then what the
        client checks before sending (``PlanClient.check_plan``), then a slot."""
        try:
            self._client.check_plan(**plan_args(goal, self._defaults, self._skill_sets).client_kwargs())
        except (ValueError, TypeError) as e:
            return self._reject(goal, f"invalid goal: {e}")
        if not self._reserve():
            return self._reject(goal, f"inactive or {self._max_goals} plans already running")
        return GoalResponse.ACCEPT

    def _reject(self, goal: PlanAction.Goal, reason: str) -> GoalResponse:
        """Log ``reason`` and publish it on ``~/goal_rejections``; the goal is rejected."""
        self.get_logger().warning(f"goal rejected: {reason}")
        fields = ("task", "skills", "priority", "escalation", "max_tokens", "deadline_ms")
        self._rejections_pub.publish(DiagnosticStatus(
            level=bytes([int(Level.WARN)]), name=f"{self.get_name()}: goal rejected", message=reason,
            hardware_id=self.endpoint, values=[KeyValue(key=f, value=str(getattr(goal, f))) for f in fields]))
        return GoalResponse.REJECT

    def _on_cancel(self, goal_handle: Any) -> CancelResponse:
        """Accepts, and sends the daemon a cancel for the goal's request without waiting for its
        answer (``PlanClient.cancel_nowait``): a cancel must not hang on a daemon that may be the
        reason for canceling. The daemon then ends the stream with ``Cancelled``; a request not yet
        sent is never sent, and one that raced ahead is closed by ``_stream_plan`` at its next
        event. NOTE: rclpy marks the goal CANCELING only after this returns, so the stream may
        end before ``is_cancel_requested`` is true; ``_canceling`` tells ``_stream_plan`` why."""
        rid = self._goal_request_id(goal_handle)
        with self._lock:
            self._canceling.add(rid)
        self._client.cancel_nowait(rid)
        return CancelResponse.ACCEPT

    def _cancel_wanted(self, goal_handle: Any, rid: str) -> bool:
        with self._lock:
            return rid in self._canceling or goal_handle.is_cancel_requested

    def _execute(self, goal_handle: Any) -> PlanAction.Result:
        rid, started = self._goal_request_id(goal_handle), time.monotonic()
        try:
            result = self._stream_plan(goal_handle, rid, started)
        finally:
            with self._lock:
                self._canceling.discard(rid)
            self._release()
        self._published(result)
        return PlanAction.Result(result=result)

    def _stream_plan(self, goal_handle: Any, rid: str, started: float) -> PlanResult:
        """Runs the goal's plan with feedback; ends the goal (succeed/abort/canceled)."""
        try:
            args = plan_args(goal_handle.request, self._defaults, self._skill_sets)
            events = self._client.stream(**args.client_kwargs(), request_id=rid)
        except (ValueError, TypeError) as e:
            goal_handle.abort()
            return self._result(rid, started, message=f"invalid goal: {e}")
        feedback = PlanAction.Feedback(request_id=rid, source=self._expected_source(args))
        plan, error = None, None
        with self._lock:
            self._running.add(rid)
        try:
            for event in () if self._cancel_wanted(goal_handle, rid) else events:
                if self._cancel_wanted(goal_handle, rid):
                    break  # closing the stream cancels the request at the daemon
                if isinstance(event, PlanText):
                    feedback.text_chars += len(event.text_delta)
                elif isinstance(event, PlanStepEvent):
                    feedback.source = event.source
                    feedback.step_index = event.index
                    feedback.steps_json.append(json.dumps(event.step.to_dict()))
                    goal_handle.publish_feedback(feedback)
                elif isinstance(event, PlanDone):
                    plan = event.plan
        except Exception as e:  # noqa: BLE001 (PlanError, or a closed client at shutdown: the goal aborts)
            error = e
        finally:
            events.close()
            with self._lock:
                self._running.discard(rid)
        if plan is not None:
            feedback.source = plan.source
            goal_handle.publish_feedback(feedback)
            goal_handle.succeed()  # valid while CANCELING too: a plan that won the race is kept
            return self._result(rid, started, plan=plan)
        if self._cancel_wanted(goal_handle, rid) and _wait_for(lambda: goal_handle.is_cancel_requested, 5.0):
            goal_handle.canceled()
            return self._result(rid, started, message="canceled")
        goal_handle.abort()
        return self._result(rid, started, message=_describe(error) if error else "the stream ended without a plan")

    def _goal_request_id(self, goal_handle: Any) -> str:
        return f"{self._robot_id}-{uuid.UUID(bytes=bytes(goal_handle.goal_id.uuid)).hex}"

    def _expected_source(self, args: PlanArgs) -> str:
        """Where a plan runs before its first step says: cloudd always in the cloud; edged where
        a forced escalation sends it ("" for auto, which edged decides per request)."""
        if self._tier == "cloud":
            return "cloud"
        if self._tier == "edge":
            return {"local": "edge", "cloud": "cloud"}.get(args.escalation, "")
        return ""

    # --- the GetPlan service ---------------------------------------------------------------------

    def _get_plan(self, request: GetPlan.Request, response: GetPlan.Response) -> GetPlan.Response:
        rid, started = f"{self._robot_id}-{uuid.uuid4().hex}", time.monotonic()
        if not self._reserve():
            response.result = self._result(rid, started, message=f"busy: inactive or {self._max_goals} plans running")
            return response
        try:
            with self._lock:
                self._running.add(rid)
            args = plan_args(request, self._defaults, self._skill_sets)
            plan = self._client.plan(**args.client_kwargs(), request_id=rid)
            response.result = self._result(rid, started, plan=plan)
        except (ValueError, TypeError) as e:
            response.result = self._result(rid, started, message=f"invalid request: {e}")
        except Exception as e:  # noqa: BLE001 (PlanError, or a closed client at shutdown)
            response.result = self._result(rid, started, message=_describe(e))
        finally:
            with self._lock:
                self._running.discard(rid)
            self._release()
        self._published(response.result)
        return response

    # --- results and diagnostics -----------------------------------------------------------------

    def _result(self, rid: str, started: float, plan: Any = None, message: str = "") -> PlanResult:
        latency = time.monotonic() - started
        if plan is None:
            return PlanResult(request_id=rid, ok=False, message=message, latency_s=latency)
        return PlanResult(request_id=rid, ok=True, plan_json=plan.to_json(), source=plan.source,
                          degraded=plan.degraded, message=plan.escalation_reason or "", latency_s=latency)

    def _published(self, result: PlanResult) -> None:
        self.status.planned(result.ok, result.latency_s, result.source)
        self._plans_pub.publish(result)
        line = f"plan {result.request_id}: source={result.source or '-'} {result.latency_s:.2f} s {result.message}"
        # NOTE: rclpy pins one severity to each logging call site, so each level has its own line.
        if result.ok:
            self.get_logger().info(line)
        else:
            self.get_logger().warning(line)

    def _publish_diagnostics(self) -> None:
        started = time.monotonic()
        try:
            daemon_status = self._probe.health()
        except Exception:  # noqa: BLE001 (any failure of the probe means "not reachable")
            daemon_status = None
        probe_ms = (time.monotonic() - started) * 1000 if daemon_status is not None else None
        self.status.probed(daemon_status, probe_ms)
        report = self.status.report(self.active_plans, self._max_goals)
        msg = DiagnosticArray()
        msg.header.stamp = self.get_clock().now().to_msg()
        msg.status = [DiagnosticStatus(level=bytes([int(report.level)]), name=f"{self.get_name()}: plan endpoint",
                                       message=report.message, hardware_id=self.endpoint,
                                       values=[KeyValue(key=k, value=v) for k, v in report.values])]
        self._diag_pub.publish(msg)


def _wait_for(predicate: Any, timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while not (ok := predicate()) and time.monotonic() < end:
        time.sleep(0.01)
    return bool(ok)


def _describe(error: Exception) -> str:
    """``Unavailable [unavailable]: no daemon answered ...``: the error's class, code and text."""
    if not isinstance(error, PlanError):
        return f"{type(error).__name__}: {error}"
    code = f" [{error.code.value}]" if error.code is not None else ""
    return f"{type(error).__name__}{code}: {error.message}"
