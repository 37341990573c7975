"""supervisorctl for vime-supervisor: status and engine actions over the control socket.

    supervisorctl [--socket PATH] status [NAME...] [--json]
    supervisorctl restart|stop|start|retire NAME...
    supervisorctl tail NAME [-n BYTES] [-f]

The output and exit codes follow supervisord's supervisorctl (LSB status codes): `status`
exits 0 when every listed engine is RUNNING (or SUSPECT), 3 when any is not, 4 when the daemon
cannot be reached or a NAME is unknown. Actions exit 0 on success, 1 when the daemon refused
one (409), 4 on an unknown NAME or an unreachable daemon. The socket is --socket, else
$VIME_SUPERVISOR_SOCKET, else /run/vime-supervisor/supervisor.sock.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import sys
import time
from typing import Any, Callable, cast

from .client import (
    ConflictError,
    DaemonUnreachable,
    Forbidden,
    SupervisorClient,
    SupervisorError,
    UnknownEngine,
)
from .protocol import DEFAULT_SOCKET, ENGINE_ACTIONS, ENV_SOCKET, RUNNING_STATES, Action, State, default_socket_path

PROG = "supervisorctl"

# LSB / supervisorctl exit statuses.
EXIT_OK = 0
EXIT_ERROR = 1  # a refused action (supervisorctl's generic failure)
EXIT_USAGE = 2
EXIT_NOT_RUNNING = 3
EXIT_UNKNOWN = 4

# States whose description is "pid N, uptime H:MM:SS, weights vV" when the engine has a pid.
_PROCESS_DESC = frozenset({State.RUNNING, State.SUSPECT, State.STALE, State.SYNCING})
_ACTION_HELP = {
    Action.RESTART: "stop and start spawned engines now",
    Action.STOP: "stop spawned engines and keep them stopped",
    Action.START: "start stopped or FATAL engines, with a fresh start budget",
    Action.RETIRE: "take engines out of routing for good",
}


def _err(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _uptime(seconds: Any) -> str:
    """As supervisord prints it: str(timedelta) at whole seconds, e.g. 1:02:03, 2 days, 0:00:05."""
    secs = max(0, int(seconds)) if isinstance(seconds, (int, float)) else 0
    return str(datetime.timedelta(seconds=secs))


def _weights(version: Any) -> str:
    return "base" if version is None else f"v{version}"


def describe(engine: dict[str, Any]) -> str:
    """supervisord's description column for one engine of the daemon's status JSON."""
    state, reason = engine.get("state"), engine.get("reason") or ""
    if state in _PROCESS_DESC:
        pid = engine.get("pid")
        # An attached engine has no pid of ours: its url says where it runs.
        where = f"pid {pid}" if pid is not None else f"attached {engine.get('url')}"
        desc = f"{where}, uptime {_uptime(engine.get('uptime'))}, weights {_weights(engine.get('weight_version'))}"
        if state == State.SUSPECT and reason:
            desc += f", {reason}"
        if engine.get("retired"):
            desc += ", retired"
        return desc
    return reason


def status_lines(engines: list[dict[str, Any]]) -> list[str]:
    """supervisord's layout: "%-{w}s%-10s%s" with w = max(30, longest name) + 3."""
    width = max([30, *(len(e["name"]) for e in engines)]) + 3
    fmt = f"%-{width}s%-10s%s"
    return [fmt % (e["name"], e["state"], describe(e)) for e in engines]


class _NoDaemon(Exception):
    """DaemonUnreachable or Forbidden, kept out of the commands' `except SupervisorError`
    (both are SupervisorErrors) so that main() answers them in one place."""

    def __init__(self, error: SupervisorError):
        super().__init__(error.message)
        self.error = error


class _Reaching:
    """The client, its calls raising _NoDaemon when the daemon cannot be reached or refuses us."""

    def __init__(self, client: SupervisorClient):
        self._client = client

    def __getattr__(self, name: str) -> Callable[..., Any]:
        verb = getattr(self._client, name)

        @functools.wraps(verb)
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return verb(*args, **kwargs)
            except (DaemonUnreachable, Forbidden) as e:
                raise _NoDaemon(e) from e
        return call


def _unreachable(e: SupervisorError) -> int:
    _err(f"{PROG}: {e.message}")
    if isinstance(e, DaemonUnreachable):
        _err(f"{PROG}: choose the socket with --socket PATH or ${ENV_SOCKET} (default {DEFAULT_SOCKET})")
    return EXIT_UNKNOWN


def _known_hint(known: list[str]) -> None:
    _err(f"{PROG}: known engines: {', '.join(known) or 'none'}")


def cmd_status(client: SupervisorClient, args: argparse.Namespace) -> int:
    try:
        st = client.status()
    except SupervisorError as e:  # a 5xx: the status is unknown
        _err(f"{PROG}: the daemon could not give its status: {e.message}")
        return EXIT_UNKNOWN
    engines = st.get("engines", [])
    by_name = {e["name"]: e for e in engines}
    unknown = [n for n in args.names if n not in by_name]
    listed = [by_name[n] for n in dict.fromkeys(args.names) if n in by_name] if args.names else engines
    if args.json:
        print(json.dumps({**st, "engines": listed}, indent=2))
    else:
        for line in status_lines(listed):
            print(line)
    sys.stdout.flush()
    for name in unknown:
        _err(f"{name}: ERROR (no such engine)")
    if unknown:
        _known_hint(list(by_name))
        return EXIT_UNKNOWN
    return EXIT_OK if all(e["state"] in RUNNING_STATES for e in listed) else EXIT_NOT_RUNNING


def cmd_action(client: SupervisorClient, args: argparse.Namespace) -> int:
    verb = getattr(client, args.command)
    rc = EXIT_OK
    for name in args.names:
        try:
            result = verb(name)
        except UnknownEngine as e:
            _err(f"{name}: ERROR (no such engine)")
            _err(f"{PROG}: {e.message}")
            rc = EXIT_UNKNOWN
        except SupervisorError as e:  # 409 refused (attached, retired), 400, 5xx
            _err(f"{name}: ERROR ({e.message})")
            rc = max(rc, EXIT_ERROR)  # 4 (unknown) outranks 1 (refused)
        else:
            print(f"{name}: {result.get('message', 'ok')}", flush=True)
    return rc


def _new_text(prev: str, cur: str) -> str:
    """What `cur` (a later tail of the same log) adds after `prev`."""
    if not prev:
        return cur
    anchor = prev[-1024:]
    i = cur.rfind(anchor)
    if i >= 0:
        return cur[i + len(anchor):]
    return cur  # more than a whole tail was written since, or the log was cut


def cmd_tail(client: SupervisorClient, args: argparse.Namespace) -> int:
    try:
        text = client.engine_log(args.name, args.bytes)
    except UnknownEngine as e:
        _err(f"{args.name}: ERROR (no such engine)")
        _err(f"{PROG}: {e.message}")
        return EXIT_UNKNOWN
    except SupervisorError as e:
        _err(f"{args.name}: ERROR ({e.message})")
        return EXIT_ERROR
    sys.stdout.write(text)
    sys.stdout.flush()
    if not args.follow:
        return EXIT_OK
    # Follow: poll every second; a wider window than the first tail so fast writers are not cut.
    window = max(args.bytes, 65536)
    prev, path = str(text), text.path
    try:
        while True:
            time.sleep(args.interval)
            try:
                cur = client.engine_log(args.name, window)
            except ConflictError:
                continue  # no log right now (between incarnations): keep waiting
            except SupervisorError as e:
                _err(f"{args.name}: ERROR ({e.message})")
                return EXIT_ERROR
            if cur.path != path:
                sys.stdout.write(f"\n==> {cur.path} (new incarnation) <==\n")
                new, path = str(cur), cur.path
            else:
                new = _new_text(prev, str(cur))
            if new:
                sys.stdout.write(new)
                sys.stdout.flush()
            prev = str(cur)
    except KeyboardInterrupt:
        sys.stdout.write("\n")
        return EXIT_OK


def cmd_incidents(client: SupervisorClient, args: argparse.Namespace) -> int:
    incidents = client.incidents()
    if args.json:
        print(json.dumps(incidents, indent=1))
        return EXIT_OK
    for inc in incidents:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(inc["time"])) if inc.get("time") else "?"
        print(f"{when}  {inc['engine']:<20} #{inc['incarnation']:<4} {inc['reason']}")
        print(f"{'':21}{inc['folder']} ({', '.join(inc['captured']) or 'nothing captured'})")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=PROG,
        description="Control the vime-supervisor daemon: engine status, restart/stop/start/retire, logs.",
        epilog="Exit status (LSB): 0 ok / all listed engines running; 1 an action was refused; "
               "3 an engine is not running; 4 daemon unreachable or no such engine.",
    )
    ap.add_argument("-s", "--socket", metavar="PATH",
                    help=f"the daemon's control socket (default ${ENV_SOCKET} or {DEFAULT_SOCKET})")
    ap.add_argument("--connect-timeout", type=float, default=2.0, metavar="S",
                    help="keep retrying an unreachable daemon this long (default 2)")
    ap.add_argument("--timeout", type=float, default=120.0, metavar="S",
                    help="wait this long for an answer, e.g. a restart's stop (default 120)")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", required=True)
    p = sub.add_parser("status", help="engine states (supervisord's format)")
    p.add_argument("names", nargs="*", metavar="NAME", help="only these engines")
    p.add_argument("--json", action="store_true", help="the daemon's status as one JSON object")
    for verb in ENGINE_ACTIONS:
        p = sub.add_parser(str(verb), help=_ACTION_HELP[verb])
        p.add_argument("names", nargs="+", metavar="NAME")
    p = sub.add_parser("tail", help="an engine's current log")
    p.add_argument("name", metavar="NAME")
    p.add_argument("-n", "--bytes", type=int, default=1600, metavar="BYTES", help="how much of the end (default 1600)")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new output until Ctrl-C")
    p.add_argument("--interval", type=float, default=1.0, help=argparse.SUPPRESS)
    p = sub.add_parser("incidents", help="post-mortems saved before unhealthy engines were stopped")
    p.add_argument("--json", action="store_true")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Every command's "daemon unreachable or refuses us" is answered once, below.
    client = cast(SupervisorClient, _Reaching(SupervisorClient(
        args.socket or default_socket_path(), connect_timeout=args.connect_timeout, timeout=args.timeout)))
    try:
        if args.command == "status":
            return cmd_status(client, args)
        if args.command == "tail":
            if args.bytes < 0:
                _err(f"{PROG}: tail -n must be >= 0, got {args.bytes}")
                return EXIT_USAGE
            return cmd_tail(client, args)
        if args.command == "incidents":
            return cmd_incidents(client, args)
        return cmd_action(client, args)
    except KeyboardInterrupt:
        return 130
    except _NoDaemon as e:
        return _unreachable(e.error)
    except SupervisorError as e:  # anything left: a bad answer, a 5xx
        _err(f"{PROG}: {e.message}")
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
