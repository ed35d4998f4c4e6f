"""Priority grants for tests whose robots send ``safety`` (a daemon's default grant refuses it:
shared.transport.priority_grants): every class to every robot, as a ``ServeConfig`` field and as
the TOML a daemon process reads."""

from shared.protocol.messages import Priority

EVERY_CLASS = tuple(p.value for p in Priority)
ROBOT_GRANTS = {"*": EVERY_CLASS}
ROBOT_GRANTS_TOML = '[serve.priority_grants]\n"*" = [' + ", ".join(f'"{c}"' for c in EVERY_CLASS) + ']\n'
