import pytest


@pytest.fixture(scope="session")
def plan_prompt(default_checkpoint):
    """A fleet plan request's tokens: the amr system prompt, a scene and a task."""
    from pathlib import Path

    system = (Path(__file__).resolve().parents[2] / "configs/prompts/amr.txt").read_text()
    return default_checkpoint.tokenizer.encode_chat([
        {"role": "system", "content": system},
        {"role": "user", "content": "Scene: Robot amr-030 at charging dock 2. Tote 12 is on waypoint 17.\n"
                                    "Task: bring tote 12 to the packing station."},
    ])
