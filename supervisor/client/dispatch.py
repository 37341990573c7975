"""`supervisorctl`: ours (vime.supervisor.client.cli), or supervisord's when the invocation is
aimed at it (vLLM pulls in supervisord, whose wheel ships a `supervisorctl` too);
`vime-supervisorctl` is always ours.

The rules, first match wins, are in docs/supervisorctl.md (beside supervisord): an explicit
$VIME_SUPERVISORCTL, supervisord's own options or actions, our options, our control socket,
a supervisord config file. Handing over runs supervisord's `supervisor.supervisorctl.main(args)`
in this process, so its output and exit statuses are its own.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
import types
from pathlib import Path
from typing import Mapping, Sequence
from urllib.parse import urlparse

ENV_CHOICE = "VIME_SUPERVISORCTL"
VIME, SUPERVISORD = "vime", "supervisord"


def _fallback_searchpaths(argv0: str) -> list[str]:
    """Where supervisord's supervisorctl looks for its config without -c (supervisor/options.py,
    Options.__init__), for when its own list cannot be read; `here` is the script's folder's parent."""
    here = os.path.dirname(os.path.dirname(argv0))
    return [os.path.join(here, "etc", "supervisord.conf"), os.path.join(here, "supervisord.conf"),
            "supervisord.conf", "etc/supervisord.conf", "/etc/supervisord.conf",
            "/etc/supervisor/supervisord.conf"]


# supervisord's supervisorctl options (getopt "hc:?is:u:p:r:" and its long names; getopt takes a
# unique prefix of a long name) and ours (argparse, which takes a unique prefix too).
_SD_SHORT_FLAGS, _SD_SHORT_VALUE = set("h?i"), set("csupr")
_SD_LONG = {"help": False, "configuration": True, "interactive": False, "serverurl": True,
            "username": True, "password": True, "history_file": True}
_OUR_SHORT_VALUE = {"s"}
_OUR_LONG = {"help": False, "socket": True, "connect-timeout": True, "timeout": True}
# Our actions, if vime.supervisor.client.cli cannot list them.
_OUR_ACTIONS = frozenset({"status", "restart", "stop", "start", "retire", "signal", "pid", "tail", "maintail",
                          "avail", "version", "incidents"})

HANDOVER_NOTE = ("supervisord's invocations (-c FILE, -s URL, -u, -p, -i, its own actions, or no vime socket "
                 f"beside a supervisord.conf) go to supervisord's supervisorctl; {ENV_CHOICE}=vime|supervisord "
                 "forces one; vime-supervisorctl is always this one.")


def _is_url(value: str) -> bool:
    """supervisord's -s takes a URL (unix:///tmp/supervisor.sock, http://localhost:9001); ours a path."""
    if "://" in value:
        return True
    parsed = urlparse(value)
    return bool(parsed.scheme) and bool(parsed.netloc or parsed.path) and not os.path.exists(value)


class _Scan:
    """What the options before the action say."""

    def __init__(self) -> None:
        self.supervisord: str | None = None  # the first supervisord-only option seen
        self.ours: str | None = None  # the first option only ours has
        self.help = False
        self.socket: str | None = None  # our -s/--socket PATH
        self.action: str | None = None


def _long(token: str, rest: list[str], scan: _Scan) -> None:
    name, eq, value = token[2:].partition("=")

    def matches(table: dict[str, bool]) -> list[str]:
        return [name] if name in table else [k for k in table if k.startswith(name)]

    sd, ours = matches(_SD_LONG), matches(_OUR_LONG)
    sd = sd if len(sd) == 1 else []  # an ambiguous prefix is an error there: not aimed at it
    ours = ours if len(ours) == 1 else []
    takes = (sd and _SD_LONG[sd[0]]) or (ours and _OUR_LONG[ours[0]])
    if takes and not eq and rest:
        value = rest.pop(0)
    if sd == ["help"] or ours == ["help"]:
        scan.help = True
    elif sd and ours:  # a prefix of both: told apart by the value
        if ours == ["socket"]:  # "--s": --serverurl URL or --socket PATH
            theirs = _is_url(value)
        else:  # "--c", "--co", "--con": --configuration FILE or --connect-timeout SECONDS
            try:
                float(value)
                theirs = False
            except ValueError:
                theirs = True
        if theirs:
            scan.supervisord = scan.supervisord or token
        else:
            scan.ours = scan.ours or token
            if ours == ["socket"]:
                scan.socket = value
    elif sd:
        scan.supervisord = scan.supervisord or token
    elif ours:
        scan.ours = scan.ours or token
        if ours == ["socket"]:
            scan.socket = value


def _short(token: str, rest: list[str], scan: _Scan) -> None:
    letters = token[1:]
    while letters:
        c, letters = letters[0], letters[1:]
        if c in _SD_SHORT_VALUE or c in _OUR_SHORT_VALUE:
            value = letters or (rest.pop(0) if rest else "")
            letters = ""
            if c == "s":
                if _is_url(value):
                    scan.supervisord = scan.supervisord or f"-s {value}"
                else:
                    scan.socket, scan.ours = value, scan.ours or "-s"
            else:
                scan.supervisord = scan.supervisord or f"-{c}"
        elif c == "h":
            scan.help = True
        elif c in _SD_SHORT_FLAGS:  # -? and -i
            scan.supervisord = scan.supervisord or f"-{c}"
        else:
            return  # an option neither has: ours answers (and says so)


def scan_options(argv: Sequence[str]) -> _Scan:
    """The options before the first positional argument (both tools take their global options
    there; getopt stops at the action word, and ours takes global options before it)."""
    scan, rest = _Scan(), list(argv)
    while rest:
        token = rest.pop(0)
        if token == "--":
            break
        if not token.startswith("-") or token == "-":
            scan.action = token
            break
        if token.startswith("--"):
            _long(token, rest, scan)
        else:
            _short(token, rest, scan)
    if scan.action is None and rest:
        scan.action = rest[0]
    return scan


def _our_socket_is_there(path: str) -> bool:
    try:
        os.stat(path)
    except PermissionError:  # the socket's folder is closed to us: ours says so
        return True
    except OSError:
        return False
    return True


def _our_package_dir() -> Path:
    return Path(__file__).resolve().parents[1]  # supervisor/, this file being supervisor/client/dispatch.py


def _is_ours(location: str | os.PathLike[str]) -> bool:
    try:
        return Path(location).resolve() == _our_package_dir()
    except OSError:
        return False


def _supervisord_spec() -> importlib.machinery.ModuleSpec | None:
    """supervisord's package `supervisor`, looked up on sys.path without the entries where the
    folder of that name is this package (a checkout's root on sys.path, as with `python -m` run
    from the repository)."""
    path = [p for p in sys.path if not _is_ours(Path(p or os.getcwd()) / "supervisor")]
    try:
        # sys.path first; then every finder (an editable install of supervisord has its own)
        spec = importlib.machinery.PathFinder.find_spec("supervisor", path) or importlib.util.find_spec("supervisor")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        if not _is_ours(loc) and (Path(loc) / "supervisorctl.py").is_file() and (Path(loc) / "options.py").is_file():
            return spec
    return None


def supervisord_installed() -> bool:
    """Whether supervisord's package `supervisor` (with its supervisorctl) is importable here."""
    mod = sys.modules.get("supervisor")
    if mod is not None:
        return not any(_is_ours(loc) for loc in getattr(mod, "__path__", []))
    return _supervisord_spec() is not None


def _import_supervisord(name: str) -> types.ModuleType:
    """supervisord's module `name` (supervisor.options, supervisor.supervisorctl): its package
    is loaded from where supervisord_installed() found it, so the submodules come from there."""
    if "supervisor" not in sys.modules:
        spec = _supervisord_spec()
        if spec is None or spec.loader is None:
            raise ImportError("supervisord's package supervisor is not installed", name="supervisor")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["supervisor"] = mod
        try:
            spec.loader.exec_module(mod)
        except BaseException:
            del sys.modules["supervisor"]
            raise
    return importlib.import_module(name)


def supervisord_searchpaths() -> list[str]:
    """supervisord's own list of config files that its supervisorctl tries without -c."""
    try:
        options = _import_supervisord("supervisor.options")
        return list(options.Options(require_configfile=False).searchpaths)
    except Exception:  # noqa: BLE001 - an older or odd supervisord: its documented list
        return _fallback_searchpaths(sys.argv[0] if sys.argv else "")


def supervisord_config(searchpaths: Sequence[str]) -> str | None:
    return next((p for p in searchpaths if os.path.exists(p)), None)


def our_actions() -> frozenset[str]:
    try:
        from vime.supervisor.client import cli as ctl

        sub = next(a for a in ctl.build_parser()._actions if a.choices and a.dest == "command")
        return frozenset(sub.choices or ())
    except Exception:  # noqa: BLE001 - ctl changed shape: the verbs it has always had
        return _OUR_ACTIONS


def choose(argv: Sequence[str], environ: Mapping[str, str] | None = None, *,
           installed: bool | None = None, searchpaths: Sequence[str] | None = None) -> tuple[str, str]:
    """(VIME or SUPERVISORD, why) for a `supervisorctl ARGV` invocation. Raises ValueError for
    a $VIME_SUPERVISORCTL value other than vime or supervisord."""
    env = os.environ if environ is None else environ
    forced = env.get(ENV_CHOICE, "").strip().lower()
    if forced in (VIME, SUPERVISORD):
        return forced, f"${ENV_CHOICE}={forced}"
    if forced:
        raise ValueError(f"${ENV_CHOICE} is {env[ENV_CHOICE]!r}; use {VIME} or {SUPERVISORD}")
    if not (supervisord_installed() if installed is None else installed):
        return VIME, "supervisord is not installed"
    scan = scan_options(argv)
    if scan.supervisord:
        return SUPERVISORD, f"{scan.supervisord} is supervisord's option"
    if scan.ours:
        return VIME, f"{scan.ours} is our option"
    if scan.help:
        return VIME, "help"

    def conf() -> str | None:  # looked up only when needed: reading supervisord's list costs ~70 ms
        return supervisord_config(supervisord_searchpaths() if searchpaths is None else searchpaths)

    if scan.action is not None and scan.action not in our_actions():
        found = conf()
        if found:
            return SUPERVISORD, f"{scan.action!r} is supervisord's action and {found} exists"
    from vime.supervisor.client import DEFAULT_SOCKET, ENV_SOCKET

    if scan.socket is None and env.get(ENV_SOCKET) == "":  # ours, set wrong: ours says so
        return VIME, f"${ENV_SOCKET} is set and empty"
    sock = scan.socket or env.get(ENV_SOCKET) or DEFAULT_SOCKET
    if _our_socket_is_there(sock):
        return VIME, f"our socket {sock} is there"
    found = conf()
    if found:
        return SUPERVISORD, f"no socket at {sock}, and supervisord's config {found} exists"
    return VIME, f"no socket at {sock}, and no supervisord config"


def _supervisord_main(argv: list[str]) -> int:
    sd = _import_supervisord("supervisor.supervisorctl")
    rc = sd.main(argv)  # exits with its own status when given an action
    return 0 if rc is None else rc


def _print_note() -> None:
    try:
        print(f"\n{HANDOVER_NOTE}", flush=True)
    except BrokenPipeError:  # the reader has gone (`supervisorctl --help | grep -q ...`): say no more
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


def _ours(argv: list[str]) -> int:
    from vime.supervisor.client import cli as ctl

    if scan_options(argv).help:
        try:
            return ctl.main(argv)
        finally:  # argparse's help exits; the note follows it
            _print_note()
    return ctl.main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        who, why = choose(argv)
    except ValueError as e:
        print(f"supervisorctl: {e}", file=sys.stderr)
        return 2
    if who == SUPERVISORD:
        if not supervisord_installed():
            print(f"supervisorctl: ${ENV_CHOICE}={SUPERVISORD}, but supervisord (PyPI \"supervisor\") is not "
                  "installed here", file=sys.stderr)
            return 2
        return _supervisord_main(argv)
    aimed = scan_options(argv).supervisord
    if aimed and why == "supervisord is not installed":
        print(f"supervisorctl: {aimed} is an option of supervisord's supervisorctl, which is not installed "
              "here (PyPI \"supervisor\"); this is vime-supervisor's", file=sys.stderr, flush=True)
    return _ours(argv)


if __name__ == "__main__":
    sys.exit(main())
