"""Pick and place with robot_sdk: skills declared once as Python functions, a plan streamed
from the daemon, each step run as soon as it has arrived (already checked against the skills).

Start a daemon first (edged on the robot, or cloudd), then:

    cloudd serve --config configs/cloudd.toml &
    python examples/pick_and_place.py "Put the red cup on shelf A3."
    python examples/pick_and_place.py --endpoint tcp://127.0.0.1:5555 --deadline-ms 20000 "Clear the table."

Copy this file and replace the bodies of the skills with calls into your robot's stack.
"""

from __future__ import annotations

import argparse
import enum
import sys

from robot_sdk import (DeadlineExceeded, InvalidPlan, Place, PlanClient, PlanDone, PlanError, PlanStepEvent,
                       PlanText, Scene, Thing, Unavailable, as_skills, skill)


class Grasp(enum.Enum):
    NORMAL = "normal"
    GENTLE = "gentle"


@skill
def move_to(location: Place) -> None:
    """drive the base to a named location"""
    print(f"    [base] driving to {location}")


@skill
def detect(object: str) -> None:
    """run the object detector to find an object that is not in the scene description"""
    print(f"    [camera] looking for {object}")


@skill
def pick(object: Thing, grasp: Grasp) -> None:
    """grasp an object with the gripper; use the gentle grasp for fragile objects"""
    print(f"    [arm] picking {object} with a {grasp.value} grasp")


@skill
def place(object: Thing, location: Place) -> None:
    """put the held object at a location"""
    print(f"    [arm] placing {object} on {location}")


@skill
def ask_human(question: str) -> None:
    """ask the operator a yes/no question when the task is unclear or unsafe"""
    print(f"    [ui] asking the operator: {question}")


SKILLS = [move_to, detect, pick, place, ask_human]
RULES = ("Safety rules: never move through a zone occupied by a person; pick glass with the gentle grasp; "
         "if the task is unclear, use ask_human.")
# Places and objects a plan may name (the grammar allows no others); detect() looks for anything else.
SCENE = Scene(places=("dining table", "kitchen counter", "shelf A3", "sink"),
              objects=("red cup", "glass jar", "sponge"),
              notes="Mobile manipulator at the dining table, gripper empty, battery 74 percent. The red cup and "
                    "the glass jar are on the dining table, the sponge in the sink. Nobody nearby.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("task", nargs="?", default="Put the red cup on shelf A3.")
    parser.add_argument("--endpoint", default="tcp://127.0.0.1:5555", help="edged or cloudd (ZeroMQ)")
    parser.add_argument("--robot-id", default="arm-1")
    parser.add_argument("--deadline-ms", type=int, default=None, help="give up on a plan after this long")
    parser.add_argument("--show-text", action="store_true", help="print the model's text as it streams")
    args = parser.parse_args(argv)

    runnable = {s.name: s for s in as_skills(SKILLS)}
    with PlanClient(args.endpoint, robot_id=args.robot_id, instructions=RULES) as client:
        print(f"task: {args.task}")
        try:
            for event in client.stream(args.task, scene=SCENE, skills=SKILLS, deadline_ms=args.deadline_ms,
                                       max_steps=6):
                if isinstance(event, PlanText) and args.show_text:
                    print(event.text_delta, end="", flush=True)
                elif isinstance(event, PlanStepEvent):
                    print(f"  step {event.index}: {event.step.skill} {event.step.args}")
                    runnable[event.step.skill].invoke(event.step.args)  # a real robot would queue it
                elif isinstance(event, PlanDone):
                    plan = event.plan
                    tier = f"{plan.source}{', degraded fallback' if plan.degraded else ''}"
                    print(f"plan from {tier}: {len(plan.steps)} steps, done={plan.done}, "
                          f"confidence={plan.confidence}, {plan.timings.get('client_e2e', 0):.2f} s")
        except DeadlineExceeded as e:
            print(f"no plan in time, holding position: {e.message}", file=sys.stderr)
            return 2
        except InvalidPlan as e:
            print(f"the planner's answer broke the skills: {e.message}", file=sys.stderr)
            return 3
        except Unavailable as e:
            print(f"no planner reachable: {e.message}", file=sys.stderr)
            return 4
        except PlanError as e:
            print(f"planning failed: {e}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
