"""supervisorctl for vime-supervisor: status, engine actions and logs over the control socket,
with supervisord 4.3's names, output and exit statuses (docs/supervisorctl.md).

    supervisorctl [--socket PATH] status [NAME|all|GLOB ...] [--json]
    supervisorctl start|restart|stop|retire|signal SIG|pid NAME|all|GLOB ...
    supervisorctl tail [-f] [-BYTES] NAME [stdout|stderr] | maintail | avail | version | incidents | pushes
"""

from __future__ import annotations

import argparse
import datetime
import fnmatch
import functools
import json
import queue
import re
import sys
import threading
import time
from typing import Any, Callable, Iterable, Iterator, cast

from . import (
    BadRequest,
    ClientCode,
    ConflictError,
    DaemonUnreachable,
    Forbidden,
    SupervisorClient,
    SupervisorError,
    UnknownEngine,
)
from ..protocol import (
    DEFAULT_SOCKET,
    ENGINE_ACTIONS,
    ENV_SOCKET,
    Action,
    EngineStatus,
    ErrorCode,
    Event,
    State,
    to_deadline,
    parse_signal,
)

PROG = "supervisorctl"

# supervisord's LSB exit statuses (supervisorctl.py: LSBInitExitStatuses, LSBStatusExitStatuses).
EXIT_OK = 0
EXIT_ERROR = 1  # GENERIC: a refused action, no such name
EXIT_USAGE = 2  # INVALID_ARGS (argparse's own usage errors exit 2 too)
EXIT_NOT_RUNNING = 3  # status: an engine is not running
# supervisord's STOPPED_STATES (states.py): `status` exits 3 when a listed engine is in one;
# on the way up or down (STARTING, BACKOFF, STOPPING, and our STALE, SYNCING, UNHEALTHY) it
# exits 0, as supervisord's does for STARTING, BACKOFF and STOPPING.
STOPPED_STATES = frozenset({State.STOPPED, State.EXITED, State.FATAL})
EXIT_UNKNOWN = 4  # status: no such name; every verb: the daemon cannot be reached
EXIT_DEAD = 7  # NOT_RUNNING: a start that failed, nothing to signal

ALL = "all"
TAIL_BYTES = 1600  # supervisord's default for tail and maintail
START_WAIT_MARGIN = 60.0  # after first_wait: a failed start's post-mortem and stop
POLL = 0.2  # how often a waiting start reads the status

# States whose description is "pid N, uptime H:MM:SS, weights vV" when the engine has a pid.
_PROCESS_DESC = frozenset({State.RUNNING, State.SUSPECT, State.STALE, State.SYNCING, State.STANDBY})
# A start has succeeded once its incarnation is up (supervisord: RUNNING, past startsecs).
_UP = frozenset({State.RUNNING, State.SUSPECT, State.STALE, State.SYNCING, State.STANDBY})
_NOT_STARTED = frozenset({State.STOPPED, State.EXITED, State.BACKOFF, State.FATAL})
_ACTION_HELP = {
    Action.RESTART: "stop and start spawned engines (waits until each is up or failed)",
    Action.STOP: "stop spawned engines and keep them stopped",
    Action.START: "start stopped, EXITED, BACKOFF or FATAL engines (waits until each is up or failed)",
    Action.RETIRE: "take engines out of routing for good",
}
_GLOB_CHARS = re.compile(r"[*?\[]")


def _err(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _out(msg: str) -> None:
    print(msg, flush=True)


def _uptime(seconds: Any) -> str:
    """As supervisord prints it: str(timedelta) at whole seconds, e.g. 1:02:03, 2 days, 0:00:05."""
    secs = max(0, int(seconds)) if isinstance(seconds, (int, float)) else 0
    return str(datetime.timedelta(seconds=secs))


def _weights(version: Any) -> str:
    return "base" if version is None else f"v{version}"


def describe(engine: EngineStatus) -> str:
    """supervisord's description column for one engine of the daemon's status JSON."""
    state, reason = engine.get("state"), engine.get("reason") or ""
    if state in _PROCESS_DESC:
        pid = engine.get("pid")
        # An attached engine has no pid of ours: its url says where it runs.
        where = f"pid {pid}" if pid is not None else f"attached {engine.get('url')}"
        desc = f"{where}, uptime {_uptime(engine.get('uptime'))}, weights {_weights(engine.get('weight_version'))}"
        if state == State.SUSPECT and reason:
            desc += f", {reason}"
        push = engine.get("push")
        if push:
            desc += f", receiving push {push['id']} ({to_deadline(push['remaining_s'])})"
        if engine.get("retired"):
            desc += ", retired"
        return desc
    return reason


def status_lines(engines: list[EngineStatus]) -> list[str]:
    """supervisord's layout: "%-{w}s%-10s%s" with w = max(30, longest name) + 3."""
    width = max([30, *(len(e["name"]) for e in engines)]) + 3
    fmt = f"%-{width}s%-10s%s"
    return [fmt % (e["name"], e["state"], describe(e)) for e in engines]


def router_line(router: dict[str, Any]) -> str:
    """The router the daemon feeds, in the same layout: `router:KIND  STATE  URL, what differs`."""
    state = str(router.get("state", "")).upper()
    desc = f"{router.get('url')}, {router.get('workers', 0)} workers"
    diffs = [f"{k} {', '.join(map(str, router[k]))}" for k in ("missing", "extra", "unknown") if router.get(k)]
    if diffs:
        desc += ", " + "; ".join(diffs)
    if router.get("observe_only"):
        desc += ", observe-only"
    proc = router.get("process")  # [router] spawn: the daemon runs it
    if proc:
        desc += f", spawned pid {proc['pid']} {proc.get('state')}" if proc.get("pid") else f", spawned, {proc.get('state')}"
        if proc.get("adopted"):
            desc += " (adopted)"
        if proc.get("restarts"):
            desc += f", {proc['restarts']} restart{'s' if proc['restarts'] != 1 else ''}"
        if proc.get("error") and proc.get("state") != "running":
            desc += f", {proc['error']}"
    if router.get("error"):
        desc += f", {router['error']}"
    width = max(30, len(f"router:{router.get('kind')}")) + 3
    return f"%-{width}s%-10s%s" % (f"router:{router.get('kind')}", state, desc)


def avail_lines(engines: list[EngineStatus]) -> list[str]:
    """supervisord's avail layout "%-32s %-9s %-9s %s": in use (retired: avail), auto (the
    daemon starts it) or manual (attached), and supervisord's default priority: engines start
    together, in no order."""
    return ["%-32s %-9s %-9s %s" % (e["name"], "avail" if e.get("retired") else "in use",
                                    "auto" if e.get("spawned") else "manual", "999:999") for e in engines]


# -- names: NAME, all, NAME:*, globs --------------------------------------------------------


def _spawned_live(e: EngineStatus) -> bool:
    return bool(e.get("spawned")) and not e.get("retired")


# What `all` and patterns take, per verb (supervisord's all/group:* skip processes a verb does
# not apply to: `stop all` leaves stopped ones alone). Names given in full are always tried.
APPLIES: dict[str, Callable[[EngineStatus], bool]] = {
    Action.START: lambda e: _spawned_live(e) and e["state"] in _NOT_STARTED,
    Action.STOP: lambda e: _spawned_live(e) and e["state"] != State.STOPPED,
    Action.RESTART: _spawned_live,
    Action.RETIRE: lambda e: not e.get("retired"),
    "signal": lambda e: _spawned_live(e) and e.get("pid") is not None,
}


class Selection:
    """The engines some NAME arguments name, in the order named, each once."""

    def __init__(self) -> None:
        self.engines: list[EngineStatus] = []
        self.explicit: set[str] = set()  # named in full (not through all or a pattern)
        self.missing: list[tuple[str, str]] = []  # (argument, "process" or "group")

    def add(self, engines: Iterable[EngineStatus]) -> None:
        for e in engines:
            if all(e["name"] != have["name"] for have in self.engines):
                self.engines.append(e)

    def missing_lines(self) -> list[str]:
        return [f"{arg}: ERROR (no such {kind})" for arg, kind in self.missing]


def select(args: Iterable[str], engines: list[EngineStatus],
           applies: Callable[[EngineStatus], bool] = lambda e: True) -> Selection:
    """`all`, a full name, `NAME:*`/`NAME:`/`NAME:NAME` (an engine is a group of one), or a shell
    glob (fnmatch, case-sensitive); `all` and patterns keep only the engines `applies` to. A
    pattern that matches no engine at all is missing, as supervisord's "no such process"."""
    by_name = {e["name"]: e for e in engines}
    sel = Selection()

    def matching(pattern: str) -> list[EngineStatus]:
        if _GLOB_CHARS.search(pattern):
            return [e for e in engines if fnmatch.fnmatchcase(e["name"], pattern)]
        return [by_name[pattern]] if pattern in by_name else []

    for arg in args:
        if arg == ALL:
            sel.add(e for e in engines if applies(e))
        elif arg in by_name:
            sel.add([by_name[arg]])
            sel.explicit.add(arg)
        elif ":" in arg:
            group, _, proc = arg.partition(":")
            groups = matching(group)
            if proc in ("", "*"):
                if not groups:
                    sel.missing.append((group, "group"))
                sel.add(e for e in groups if applies(e))
                continue
            found = [e for e in groups if fnmatch.fnmatchcase(e["name"], proc)]
            if not found:
                sel.missing.append((arg, "process"))
            elif _GLOB_CHARS.search(arg):
                sel.add(e for e in found if applies(e))
            else:  # NAME:NAME, supervisord's full name of a one-process program
                sel.add(found)
                sel.explicit.add(found[0]["name"])
        elif _GLOB_CHARS.search(arg):
            found = matching(arg)
            if not found:
                sel.missing.append((arg, "process"))
            sel.add(e for e in found if applies(e))
        else:
            sel.missing.append((arg, "process"))
    return sel


# -- the client, and the daemon being away ----------------------------------------------------


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
    if isinstance(e, DaemonUnreachable) and e.code != ClientCode.BAD_SOCKET_PATH:  # that one says what to give
        _err(f"{PROG}: choose the socket with --socket PATH or ${ENV_SOCKET} (default {DEFAULT_SOCKET})")
    return EXIT_UNKNOWN


def _known_hint(engines: list[EngineStatus]) -> None:
    _err(f"{PROG}: known engines: {', '.join(e['name'] for e in engines) or 'none'}")


def _report_missing(sel: Selection, engines: list[EngineStatus]) -> bool:
    for line in sel.missing_lines():
        _err(line)
    if sel.missing:
        _known_hint(engines)
    return bool(sel.missing)


# -- status, pid, avail, version ----------------------------------------------------------------


def cmd_status(client: SupervisorClient, args: argparse.Namespace) -> int:
    try:
        st = client.status()
    except SupervisorError as e:  # a 5xx: the status is unknown
        _err(f"{PROG}: the daemon could not give its status: {e.message}")
        return EXIT_UNKNOWN
    engines = st.get("engines", [])
    if args.names:
        sel = select(args.names, engines)
        listed = sel.engines
    else:
        sel, listed = Selection(), engines
    if args.json:
        print(json.dumps({**st, "engines": listed}, indent=2))
    else:
        for line in status_lines(listed):
            print(line)
        if not args.names and st.get("router"):
            print(router_line(st["router"]))
    sys.stdout.flush()
    if _report_missing(sel, engines):
        return EXIT_UNKNOWN
    return EXIT_NOT_RUNNING if any(e["state"] in STOPPED_STATES for e in listed) else EXIT_OK


def cmd_pid(client: SupervisorClient, args: argparse.Namespace) -> int:
    """supervisord's pid: the daemon's without a name; else each engine's, 0 when it has none
    (7 for a name given in full, as supervisord; 1 for an attached engine: its pid is not ours)."""
    st = client.status()
    if not args.names:
        _out(str(st["daemon"]["pid"]))
        return EXIT_OK
    engines = st.get("engines", [])
    sel = select(args.names, engines)
    rc = EXIT_OK
    for arg, _kind in sel.missing:
        _err(f"No such process {arg}")
        rc = EXIT_ERROR
    for e in sel.engines:
        _out(str(e.get("pid") or 0))
        if e.get("pid") is None and e["name"] in sel.explicit:
            if e.get("spawned"):
                rc = max(rc, EXIT_DEAD)
            else:
                _err(f"{e['name']}: attached ({e.get('url')}): its process is not the daemon's")
                rc = max(rc, EXIT_ERROR)
    return rc


def cmd_avail(client: SupervisorClient, args: argparse.Namespace) -> int:
    for line in avail_lines(client.status().get("engines", [])):
        _out(line)
    return EXIT_OK


def cmd_version(client: SupervisorClient, args: argparse.Namespace) -> int:
    _out(str(client.status().get("daemon", {}).get("version") or "unknown"))
    return EXIT_OK


# -- start, stop, restart, retire ---------------------------------------------------------------


class _Start:
    """A start (or restart) whose outcome is being waited for: `target` is its incarnation;
    `answered` (time.time()) when the daemon answered the request."""

    def __init__(self, name: str, target: int, answered: float, limit: float):
        self.name, self.target, self.answered, self.limit = name, target, answered, limit
        self.deadline = time.monotonic() + limit


def transition_outcome(ev: dict[str, Any], target: int, answered: float = 0.0) -> tuple[bool, str] | None:
    """(started, why not) when transition event `ev` concludes incarnation `target`'s start;
    None when it does not (yet). `answered`: when the start was answered (the daemon is on
    this host, on this clock): a restart's own stop, before it, cancels nothing."""
    inc, to, reason = ev.get("incarnation", 0), ev.get("to_state"), ev.get("reason") or ""
    if inc < target:  # the start waits for the last incarnation's clean-up; a later stop cancels it
        return (False, f"{to}: {reason}") if to == State.STOPPED and ev.get("ts", 0.0) > answered else None
    if inc > target:  # only after a reconnect can its own end have gone unseen
        return False, f"{to} as incarnation {inc}: {reason}"
    if to in _UP:
        return True, ""
    if to in _NOT_STARTED:
        return False, f"{to}: {reason}"
    return None  # STARTING, or a failing start's STOPPING


def start_outcome(e: EngineStatus, target: int, since: float = float("inf")) -> tuple[bool, str] | None:
    """The same read from a status entry (when the event stream is not there): a state passed
    between two reads is not seen, so the stream is preferred. `since`: seconds since the
    start was answered (a state older than that is the restart's own stop)."""
    state, inc, reason = e["state"], e.get("incarnation", 0), e.get("reason") or ""
    if inc < target:
        newer = e.get("state_age", 0.0) < since
        return (False, f"{state}: {reason}") if state == State.STOPPED and newer else None
    if inc > target:
        return False, f"{state} as incarnation {inc}: {reason}"
    if state in _UP:
        return True, ""
    if state in (State.UNHEALTHY, State.STOPPING):
        # Up, then condemned or stopped: it did start. A failing start passes STOPPING too,
        # before it was ever up (no uptime): wait for where that ends.
        return (True, "") if e.get("uptime") is not None else None
    if state == State.STARTING:
        return None
    return False, f"{state}: {reason}"


class _Feed:
    """The daemon's event stream, read on a thread so that a wait can time out. Opened before
    the actions, so every transition they cause is in it."""

    def __init__(self, client: SupervisorClient, timeout: float):
        self.client = client
        self.q: queue.Queue[Any] = queue.Queue()
        gen = client.events()
        threading.Thread(target=self._read, args=(gen,), daemon=True).start()
        try:
            first = self.q.get(timeout=timeout)
        except queue.Empty:
            first = None
        self.ok = isinstance(first, dict) and first.get("event") == Event.HELLO

    def _read(self, gen: Iterator[Any]) -> None:
        try:
            for ev in gen:
                self.q.put(ev)
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            self.q.put(e)

    def close(self) -> None:
        self.client.close()


def _conclude(p: _Start, outcome: tuple[bool, str] | None, state: str) -> int:
    if outcome is None:
        _err(f"{p.name}: ERROR (not started within {p.limit:g}s: still {state}; "
             f"`{PROG} status {p.name}` shows how it goes on)")
        return EXIT_ERROR
    if outcome[0]:
        _out(f"{p.name}: started")
        return EXIT_OK
    kind = "spawn error" if "spawn failed" in outcome[1] else "abnormal termination"
    _err(f"{p.name}: ERROR ({kind}) {outcome[1]}")
    return EXIT_DEAD


def _wait_for_starts(client: SupervisorClient, pending: list[_Start], feed: _Feed | None) -> int:
    """Each start's outcome, printed when it is known: from the event stream, else (no stream,
    or it reconnected and may have missed some) from status reads."""
    rc = EXIT_OK
    last_state: dict[str, str] = {}
    poll = feed is None
    while pending:
        if poll:
            time.sleep(POLL)
            by_name = {e["name"]: e for e in client.status().get("engines", [])}
            for p in list(pending):
                e = by_name.get(p.name)
                since = time.time() - p.answered
                outcome = start_outcome(e, p.target, since) if e is not None else (False, "gone from the status")
                last_state[p.name] = e["state"] if e is not None else "?"
                if outcome is not None:
                    pending.remove(p)
                    rc = max(rc, _conclude(p, outcome, last_state[p.name]))
        else:
            assert feed is not None
            wait = max(0.0, min(p.deadline for p in pending) - time.monotonic())
            try:
                ev = feed.q.get(timeout=wait)
            except queue.Empty:
                ev = None
            if isinstance(ev, BaseException) or (isinstance(ev, dict) and ev.get("event") == Event.RECONNECTED):
                poll = True  # events may have been missed: read the status from now on
                continue
            if isinstance(ev, dict) and ev.get("event") == Event.TRANSITION:
                for p in [p for p in pending if p.name == ev.get("engine")]:
                    last_state[p.name] = ev.get("to_state") or "?"
                    outcome = transition_outcome(ev, p.target, p.answered)
                    if outcome is not None:
                        pending.remove(p)
                        rc = max(rc, _conclude(p, outcome, last_state[p.name]))
        now = time.monotonic()
        for p in [p for p in pending if now >= p.deadline]:
            pending.remove(p)
            state = last_state.get(p.name) or next(
                (e["state"] for e in client.status().get("engines", []) if e["name"] == p.name), "?")
            rc = max(rc, _conclude(p, None, state))
    return rc


def cmd_action(client: SupervisorClient, args: argparse.Namespace) -> int:
    verb = args.command
    st = client.status()
    engines = st.get("engines", [])
    sel = select(args.names, engines, APPLIES[verb])
    rc = EXIT_ERROR if _report_missing(sel, engines) else EXIT_OK
    wait = verb in (Action.START, Action.RESTART) and args.wait
    feed = None
    if wait and sel.engines:
        raw = client._client if isinstance(client, _Reaching) else client
        feed = _Feed(SupervisorClient(raw.socket_path, connect_timeout=args.connect_timeout, timeout=args.timeout),
                     args.connect_timeout + 5)
        if not feed.ok:  # no stream (too many readers, say): status reads instead
            feed.close()
            feed = None
    pending: list[_Start] = []
    try:
        for e in sel.engines:
            name = e["name"]
            try:
                result = getattr(client, verb)(name)
                answered = time.time()
            except UnknownEngine:
                _err(f"{name}: ERROR (no such process)")
                rc = max(rc, EXIT_ERROR)
                continue
            except SupervisorError as err:  # 409 refused (attached, retired), 400, 5xx
                _err(f"{name}: ERROR ({err.message})")
                rc = max(rc, EXIT_ERROR)
                continue
            message, state, inc = result.get("message", "ok"), result.get("state"), result.get("incarnation")
            if not wait or inc is None:  # --no-wait (or a daemon too old to say the incarnation)
                _out(f"{name}: {message}")
                continue
            if message.startswith("already "):
                if state in _UP or state == State.STARTING:
                    _err(f"{name}: ERROR (already started)")  # supervisord's, exit status 0 as there
                else:  # UNHEALTHY or STOPPING: being stopped, the start was not taken
                    _err(f"{name}: ERROR ({message}; try again once it is stopped)")
                    rc = max(rc, EXIT_ERROR)
                continue
            if verb == Action.RESTART and e["state"] != State.STOPPED:
                _out(f"{name}: stopped")
            # A start that waits for the last incarnation's clean-up begins the next incarnation.
            target = inc if state == State.STARTING else inc + 1
            limit = args.wait_timeout if args.wait_timeout is not None else \
                float(e.get("first_wait") or 600.0) + START_WAIT_MARGIN
            pending.append(_Start(name, target, answered, limit))
        return max(rc, _wait_for_starts(client, pending, feed))
    finally:
        if feed is not None:
            feed.close()


def cmd_signal(client: SupervisorClient, args: argparse.Namespace) -> int:
    try:
        parse_signal(args.sig)
    except ValueError as bad:  # refused before anything is sent (the daemon checks it too)
        _err(f"{PROG}: {bad}")
        return EXIT_ERROR
    st = client.status()
    engines = st.get("engines", [])
    sel = select(args.names, engines, APPLIES["signal"])
    rc = EXIT_ERROR if _report_missing(sel, engines) else EXIT_OK
    for e in sel.engines:
        name = e["name"]
        try:
            client.signal(name, args.sig)
        except UnknownEngine:
            _err(f"{name}: ERROR (no such process)")
            rc = max(rc, EXIT_ERROR)
        except BadRequest as err:
            _err(f"{name}: ERROR (bad signal name)" if err.code == ErrorCode.BAD_SIGNAL else f"{name}: ERROR ({err.message})")
            rc = max(rc, EXIT_ERROR)
        except ConflictError as err:
            if err.code == ErrorCode.NOT_RUNNING:
                _err(f"{name}: ERROR (not running)")
                rc = max(rc, EXIT_DEAD)
            else:  # attached, or retired
                _err(f"{name}: ERROR ({err.message})")
                rc = max(rc, EXIT_ERROR)
        except SupervisorError as err:
            _err(f"{name}: ERROR ({err.message})")
            rc = max(rc, EXIT_ERROR)
        else:
            _out(f"{name}: signalled")
    return rc


# -- tail, maintail -----------------------------------------------------------------------------


def _new_text(prev: str, cur: str) -> str:
    """What `cur` (a later tail of the same log) adds after `prev`."""
    if not prev:
        return cur
    anchor = prev[-1024:]
    i = cur.rfind(anchor)
    if i >= 0:
        return cur[i + len(anchor):]
    return cur  # more than a whole tail was written since, or the log was cut


def _follow(fetch: Callable[[int], Any], first: Any, nbytes: int, interval: float, label: str) -> int:
    """Print what the log gains, polling `fetch` every `interval`, until Ctrl-C. A new path
    (an engine's next incarnation) is followed from its start, and said so."""
    window = max(nbytes, 65536)  # wider than the first tail, so a fast writer is not cut
    prev, path = str(first), first.path
    try:
        while True:
            time.sleep(interval)
            try:
                cur = fetch(window)
            except ConflictError:
                continue  # no log right now (between incarnations): keep waiting
            except SupervisorError as e:
                _err(f"{label}: ERROR ({e.message})")
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


def cmd_tail(client: SupervisorClient, args: argparse.Namespace) -> int:
    # One log file per incarnation holds both stdout and stderr: either channel reads it.
    try:
        text = client.engine_log(args.name, args.bytes)
    except UnknownEngine:
        _err(f"{args.name}: ERROR (no such process)")
        return EXIT_ERROR
    except SupervisorError as e:
        _err(f"{args.name}: ERROR ({e.message})")
        return EXIT_ERROR
    return _show(text, lambda n: client.engine_log(args.name, n), args, args.name)


def _show(text: str, fetch: Callable[[int], str], args: argparse.Namespace, label: str) -> int:
    """Print a log's tail; with -f go on following it as supervisord's tail -f does."""
    if args.follow:
        _err("==> Press Ctrl-C to exit <==")
    sys.stdout.write(text)
    sys.stdout.flush()
    if not args.follow:
        return EXIT_OK
    return _follow(fetch, text, args.bytes, args.interval, label)


def cmd_maintail(client: SupervisorClient, args: argparse.Namespace) -> int:
    try:
        text = client.daemon_log(args.bytes)
    except ConflictError as e:  # no_log: stderr is the journal, a pipe or a terminal
        _err("vime-supervisor: ERROR (no log file)")
        message = e.message
        if args.follow:  # the daemon's message names the journal's command: follow it
            message = re.sub(r"(journalctl -u \S+)", r"\1 -f", message)
        _err(f"{PROG}: {message}")
        return EXIT_ERROR
    except SupervisorError as e:
        _err(f"vime-supervisor: ERROR ({e.message})")
        return EXIT_ERROR
    return _show(text, client.daemon_log, args, "vime-supervisor")


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


def cmd_pushes(client: SupervisorClient, args: argparse.Namespace) -> int:
    """The trainer's announced weight pushes in flight, one line each (none: no output)."""
    pushes = client.pushes()
    if args.json:
        print(json.dumps(pushes, indent=1))
        return EXIT_OK
    for p in pushes:
        due = to_deadline(p["remaining_s"])
        print(f"{p['push']:<16} v{p['version']:<8} {len(p['engines'])} engines, {p['bytes']} bytes, "
              f"{p['age_s']:.0f}s old, {due} ({p['deadline_s']:g}s): {', '.join(p['engines'])}")
    return EXIT_OK


# -- arguments ----------------------------------------------------------------------------------


_NAMES_HELP = "engine names, `all`, NAME:* or shell globs (engine-*)"
_VALUE_OPTIONS = {"-s", "--socket", "--connect-timeout", "--timeout"}


def _bytes_modifiers(argv: list[str]) -> list[str]:
    """supervisord's `tail -100 NAME` / `maintail -100`: -N (bytes) becomes --bytes=N."""
    out, i, command = [], 0, None
    while i < len(argv):
        tok = argv[i]
        if command is None:
            if tok in _VALUE_OPTIONS:  # a global option and its value
                out += argv[i:i + 2]
                i += 2
                continue
            if not tok.startswith("-"):
                command = tok
        elif command in ("tail", "maintail") and re.fullmatch(r"-\d+", tok):
            tok = f"--bytes={tok[1:]}"
        out.append(tok)
        i += 1
    return out


def _add_follow_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new output until Ctrl-C")
    p.add_argument("-n", "--bytes", type=int, default=TAIL_BYTES, metavar="BYTES",
                   help=f"how much of the end, in bytes; also written -BYTES, e.g. -100 (default {TAIL_BYTES})")
    p.add_argument("--interval", type=float, default=1.0, help=argparse.SUPPRESS)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=PROG,
        description="Control the vime-supervisor daemon: engine status, start/stop/restart/retire/signal, logs.",
        epilog="Exit status (supervisord's LSB codes): status: 3 a listed engine STOPPED, EXITED or FATAL, else 0; "
               "4 no such name; other commands: 0 ok, 1 refused or no such name, 2 usage, 7 an engine not "
               "running (a failed start, nothing to signal); 4 daemon unreachable.",
    )
    ap.add_argument("-s", "--socket", metavar="PATH",
                    help=f"the daemon's control socket (default ${ENV_SOCKET} or {DEFAULT_SOCKET})")
    ap.add_argument("--connect-timeout", type=float, default=2.0, metavar="S",
                    help="keep retrying an unreachable daemon this long (default 2)")
    ap.add_argument("--timeout", type=float, default=120.0, metavar="S",
                    help="wait this long for an answer, e.g. a restart's stop (default 120)")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", required=True)
    p = sub.add_parser("status", help="engine states (supervisord's format)")
    p.add_argument("names", nargs="*", metavar="NAME", help=_NAMES_HELP + " (default: all)")
    p.add_argument("--json", action="store_true", help="the daemon's status as one JSON object")
    for verb in ENGINE_ACTIONS:
        p = sub.add_parser(str(verb), help=_ACTION_HELP[verb])
        p.add_argument("names", nargs="+", metavar="NAME", help=_NAMES_HELP)
        if verb in (Action.START, Action.RESTART):
            p.add_argument("--wait", dest="wait", action="store_true", default=True,
                           help="wait until each engine is up (NAME: started) or has failed (the default)")
            p.add_argument("--no-wait", dest="wait", action="store_false", help="return once the start is asked for")
            p.add_argument("--wait-timeout", type=float, metavar="S",
                           help=f"give up waiting after S seconds (default: the engine's first_wait + "
                                f"{START_WAIT_MARGIN:g})")
    p = sub.add_parser("signal", help="send a signal to spawned engines' server processes")
    p.add_argument("sig", metavar="SIG", help="a name (HUP, TERM, USR1, SIGHUP, ...) or a number")
    p.add_argument("names", nargs="+", metavar="NAME", help=_NAMES_HELP)
    p = sub.add_parser("pid", help="the daemon's pid, or engines' (0: none)")
    p.add_argument("names", nargs="*", metavar="NAME", help=_NAMES_HELP)
    p = sub.add_parser("tail", help="the end of an engine's log (-f follows it)")
    _add_follow_options(p)
    p.add_argument("name", metavar="NAME")
    p.add_argument("channel", nargs="?", choices=("stdout", "stderr"), default="stdout",
                   help="either: the engine's one log holds both")
    p = sub.add_parser("maintail", help="the end of the daemon's own log (-f follows it)")
    _add_follow_options(p)
    sub.add_parser("avail", help="the configured engines (supervisord's avail lines)")
    sub.add_parser("version", help="the daemon's version")
    p = sub.add_parser("incidents", help="post-mortems saved before unhealthy engines were stopped")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("pushes", help="the trainer's announced weight pushes in flight")
    p.add_argument("--json", action="store_true")
    return ap


COMMANDS: dict[str, Callable[[SupervisorClient, argparse.Namespace], int]] = {
    "status": cmd_status, "signal": cmd_signal, "pid": cmd_pid, "tail": cmd_tail, "maintail": cmd_maintail,
    "avail": cmd_avail, "version": cmd_version, "incidents": cmd_incidents, "pushes": cmd_pushes,
    **{str(verb): cmd_action for verb in ENGINE_ACTIONS},
}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(_bytes_modifiers(list(sys.argv[1:] if argv is None else argv)))
    if getattr(args, "bytes", 0) < 0:
        _err(f"{PROG}: {args.command} -n must be >= 0, got {args.bytes}")
        return EXIT_USAGE
    # Every command's "daemon unreachable or refuses us" is answered once, below.
    client = cast(SupervisorClient, _Reaching(SupervisorClient(
        args.socket, connect_timeout=args.connect_timeout, timeout=args.timeout)))
    try:
        return COMMANDS[args.command](client, args)
    except KeyboardInterrupt:
        return 130
    except _NoDaemon as e:
        return _unreachable(e.error)
    except SupervisorError as e:  # anything left: a bad answer, a 5xx
        _err(f"{PROG}: {e.message}")
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
