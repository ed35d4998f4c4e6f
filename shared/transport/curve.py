"""CURVE encryption and authentication between robots (edged) and the fleet (cloudd).

Keys are ZeroMQ certificate files (``zmq.auth.create_certificates``): ``<name>.key`` holds the
public key, ``<name>.key_secret`` both. cloudd has a server key pair and a directory of the
robots' public keys it accepts; each robot has its own key pair and cloudd's public key. A
robot whose key is not in that directory fails the handshake and never reaches the daemon.

A key is an identity: a robot is the name of its key file in that directory (``amr-001.key``
is robot ``amr-001``), and ZeroMQ tags each message with the key that sent it (its ZAP
User-Id), so the daemon knows who asks (``ServerCurve.identify``). Operators (fleetctl) have
their keys in a directory of their own. Messages with no key come from inside the daemon's
process (``inproc`` skips CURVE): its own HTTP front, trusted as an operator.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator


@dataclass(frozen=True)
class Caller:
    """Who sent a message: a robot (the name of its key), or an operator (``robot`` None: an
    operator's key, the daemon's own process, or anyone when CURVE is off and the daemon is on
    loopback only). ``operator_key``: an operator's own key, which may use every priority class;
    the other operators act for the ``robot_id`` they send (``shared.transport.priority_grants``)."""

    robot: str | None = None
    operator_key: bool = False


OPERATOR = Caller()
OPERATOR_KEY = Caller(operator_key=True)


def check_server_keys(secret_key: str, authorized_dir: str, operator_dir: str) -> None:
    """A daemon's ``[serve]`` CURVE settings (``curve_secret_key``, ``curve_authorized_dir``,
    ``curve_operator_dir``; "" = unset) hold together: ValueError naming the keys that do not.
    The first two turn CURVE on together; operator keys need it on."""
    if bool(secret_key) != bool(authorized_dir):
        raise ValueError("curve_secret_key and curve_authorized_dir: give both (CURVE on) or neither")
    if operator_dir and not secret_key:
        raise ValueError("curve_operator_dir: needs CURVE on (curve_secret_key and curve_authorized_dir)")


@dataclass(frozen=True)
class ClientCurve:
    """What a client needs: the server's public key and its own key pair (z85 bytes)."""

    server_public: bytes
    public: bytes
    secret: bytes

    @classmethod
    def from_files(cls, server_public_file: Path | str, client_secret_file: Path | str) -> ClientCurve:
        server_public, _ = zmq.auth.load_certificate(Path(server_public_file).expanduser())
        public, secret = zmq.auth.load_certificate(Path(client_secret_file).expanduser())
        if secret is None:
            raise ValueError(f"{client_secret_file}: no secret key in it (use the .key_secret file)")
        return cls(server_public, public, secret)

    def apply(self, socket: zmq.Socket) -> None:
        socket.curve_serverkey = self.server_public
        socket.curve_publickey = self.public
        socket.curve_secretkey = self.secret


class ServerCurve:
    """Makes server sockets CURVE-only, admitting the public keys in ``authorized_dir`` and
    ``operator_dir`` plus those added with ``authorize`` (e.g. an in-process client's own key).

    ``reload()`` reads the directories again (a daemon does on SIGHUP): connections stay, new
    handshakes see the new keys, and a removed key's next message is refused (``allows``).
    One ZAP authenticator thread per context; ``stop()`` ends it. ``refused`` counts handshakes
    turned away.
    """

    def __init__(self, context: zmq.Context, server_secret_file: Path | str, authorized_dir: Path | str,
                 operator_dir: Path | str | None = None):
        public, secret = zmq.auth.load_certificate(Path(server_secret_file).expanduser())
        if secret is None:
            raise ValueError(f"{server_secret_file}: no secret key in it (use the .key_secret file)")
        self.public, self._secret = public, secret
        self._dirs = (authorized_dir, operator_dir)
        self._runtime: set[bytes] = set()  # keys authorized in this process
        self.reload()
        self.refused = 0
        self._auth = ThreadAuthenticator(context)
        self._auth.start()
        self._auth.configure_curve_callback(domain="*", credentials_provider=self)

    def callback(self, domain: str, key: bytes) -> bool:
        """ZAP: admit ``key`` (z85)?"""
        ok = key in self._allowed
        self.refused += not ok
        return ok

    def reload(self) -> tuple[int, int]:
        """Read the key directories again; returns (robot keys, operator keys) now admitted.
        The key sets are swapped whole, so a reader on another thread sees the old or the new."""
        authorized_dir, operator_dir = self._dirs
        robots = _public_keys(authorized_dir, "authorized robot keys")  # z85 key -> robot name
        operators = set(_public_keys(operator_dir, "operator keys")) if operator_dir else set()
        self._robots, self._operators = robots, operators
        self._allowed = set(robots) | operators | self._runtime
        return len(robots), len(operators)

    def allows(self, user_id: str) -> bool:
        """Whether the key behind a message's User-Id is (still) admitted."""
        return user_id.encode() in self._allowed

    def identify(self, user_id: str | None) -> Caller:
        """The caller behind a message's ZAP User-Id (the z85 key; None: no key, from inside
        this process). Keys authorized at run time (``local_client``) are operators without an
        operator key: they act for the robot_id they send."""
        if user_id is None:
            return OPERATOR
        key = user_id.encode()
        robot = self._robots.get(key)
        if robot is not None:
            return Caller(robot)
        return OPERATOR_KEY if key in self._operators else OPERATOR

    def authorize(self, public: bytes) -> None:
        self._runtime.add(public)
        self._allowed = self._allowed | {public}

    def local_client(self) -> ClientCurve:
        """A fresh key pair, authorized, for a client in this process."""
        public, secret = zmq.curve_keypair()
        self.authorize(public)
        return ClientCurve(self.public, public, secret)

    def apply(self, socket: zmq.Socket) -> None:
        socket.curve_server = True
        socket.curve_publickey = self.public
        socket.curve_secretkey = self._secret

    def stop(self) -> None:
        self._auth.stop()


def _public_keys(directory: Path | str, what: str) -> dict[bytes, str]:
    """z85 public key -> name (the file's stem) of every ``*.key`` in ``directory``."""
    folder = Path(directory).expanduser()
    if not folder.is_dir():
        raise ValueError(f"{folder}: no such directory of {what}")
    keys = {}
    for path in sorted(folder.glob("*.key")):
        public, _ = zmq.auth.load_certificate(path)
        keys[public] = path.stem
    return keys


def create_keys(directory: Path | str, name: str) -> tuple[Path, Path]:
    """A new key pair ``<directory>/<name>.key`` (public) and ``.key_secret`` (readable by its
    owner only: 0600); returns both paths."""
    directory = Path(directory).expanduser()
    directory.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(str(directory), name)
    Path(secret).chmod(0o600)
    return Path(public), Path(secret)
