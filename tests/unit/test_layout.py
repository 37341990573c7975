"""The layout's import rule, read from the source (every import statement, function-local ones
included): which layer may import which, no cycle among the daemon's modules, and a wheel that
ships every package folder.

    states    <- nothing of ours
    protocol  <- states
    client    <- protocol, states
    router    <- nothing of ours (supervisor/router/'s adapters: __init__, base, plan, vllm_router, smg;
                 for daemon and cluster; its feed, child and link are the daemon's)
    daemon    <- protocol, states, weight_sync, router   (never client, trainer or harness)
    trainer   <- client, protocol, states, weight_sync, cluster (rl_loop --cluster)
    cluster   <- client, protocol, states, router   (Ray; the daemon never imports it or Ray)
    weight_sync <- nothing of ours (vLLM loads it in every engine process)
    harness, bench, tests <- anything

Inside the daemon (vime.supervisor), five groups, each importing only itself and those below:

    base     states, protocol, errors, knobs, settings, config, tasks, logs, events
    engine   supervisor/engine/: runner, adoption, heartbeat, fsm, process, activity, probes, http1, warmup,
             postmortem, retention, view, fingerprint
    fleet    policy, fleet, sync, metrics, status, journal, restore, selfwatch, healthz, router/feed,
             router/child, router/link
    service  daemon, reexec, sdnotify, limits, reap, control, __main__
    client   supervisor/client/ and the supervisorctl entry module (the contract only, above)

Seams are typed: an attribute annotated `Any` that another module assigns (the router, the
fleet's sender) is wiring no checker sees; it takes a Protocol or a class instead. And "is this
pid ours?" has one answer, in engine/adoption.py, for every child (engines and the router).
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {"supervisor": "vime.supervisor", "trainer": "vime.trainer",
           "weight_sync": "vime.weight_sync", "harness": "vime.harness", "cluster": "vime.cluster"}
CLIENT_SIDE = ("vime.supervisor.client", "vime.supervisor.supervisorctl")
CONTRACT = ("vime.supervisor.protocol", "vime.supervisor.states")
ROUTER = "vime.supervisor.router"  # the adapters: a layer of their own inside the daemon's folder
# The daemon's side of the router, beside its adapters: in the fleet group, not the router layer.
ROUTER_DAEMON = {ROUTER + "." + m for m in ("feed", "child", "link")}


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    parts[0] = FOLDERS[parts[0]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    found = {}
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            found[module_name(path)] = path
    return found


MODULES = modules()


def imports_of(name: str, path: Path) -> set[str]:
    """The modules of ours that `name` imports (a `from pkg import mod` counts as pkg.mod)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in MODULES else mod for a in node.names]
        else:
            continue
        for t in targets:
            # the longest module of ours that t names
            while t and t not in MODULES:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


GRAPH = {name: imports_of(name, path) for name, path in MODULES.items()}


def layer(name: str) -> str:
    if name in CONTRACT:
        return name.rpartition(".")[2]
    if name.startswith(CLIENT_SIDE):
        return "client"
    if name in ROUTER_DAEMON:
        return "daemon"
    if name == ROUTER or name.startswith(ROUTER + "."):
        return "router"
    return name.split(".")[1].replace("supervisor", "daemon")


ALLOWED = {
    "states": set(),
    "protocol": {"states"},
    "client": {"client", "protocol", "states"},
    "router": {"router"},
    "daemon": {"daemon", "protocol", "states", "weight_sync", "router"},
    "trainer": {"trainer", "client", "protocol", "states", "weight_sync", "cluster"},
    "weight_sync": {"weight_sync"},
    "cluster": {"cluster", "client", "protocol", "states", "router"},
    "harness": {"harness", "daemon", "router", "client", "protocol", "states", "trainer", "weight_sync", "cluster"},
}


_D = "vime.supervisor."
GROUPS = {  # lowest first
    "base": {_D + m for m in ("states", "protocol", "errors", "knobs", "settings", "config", "tasks", "logs",
                              "events")},
    "engine": {_D + "engine"} | {_D + "engine." + m for m in ("runner", "fsm", "process", "activity", "probes", "heartbeat", "adoption",
                                                             "http1", "warmup", "postmortem", "retention", "view",
                                                             "fingerprint")},
    "fleet": {_D + m for m in ("policy", "fleet", "sync", "metrics", "status", "journal", "restore", "selfwatch",
                                "healthz")} | ROUTER_DAEMON,
    "service": {"vime.supervisor"} | {_D + m for m in ("daemon", "reexec", "sdnotify", "limits", "reap", "control",
                                                       "__main__")},
}
ORDER = list(GROUPS)


def group(name: str) -> str | None:
    """The daemon group of a module of vime.supervisor; "client" or "router" for those layers."""
    if layer(name) in ("client", "router"):
        return layer(name)
    return next((g for g, members in GROUPS.items() if name in members), None)


def test_every_daemon_module_is_in_one_group():
    # A new module must be placed: a module left out would escape the rule below.
    daemon = {n for n in MODULES if n.startswith("vime.supervisor")}
    assert not sorted(n for n in daemon if group(n) is None), "add it to GROUPS (and the docstring above)"
    assert all(m in MODULES for members in GROUPS.values() for m in members), "a module in GROUPS is gone"


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n.startswith("vime.supervisor")))
def test_each_daemon_module_imports_only_its_group_and_those_below(name):
    mine = group(name)
    if mine not in GROUPS:
        return  # the client side and the router: held by the layer rule
    below = set(ORDER[: ORDER.index(mine) + 1])
    up = sorted(t for t in GRAPH[name] if group(t) in GROUPS and group(t) not in below)
    assert not up, f"{name} ({mine}) imports {up} from a group above it: see the groups in this file's docstring"


def test_the_walk_sees_the_modules_it_judges():
    # A walk that found nothing would pass every rule below.
    assert {"vime.supervisor.daemon", "vime.supervisor.engine.fsm", "vime.supervisor.client",
            "vime.trainer.rollout", "vime.weight_sync.sender", "vime.harness.demo"} <= MODULES.keys()
    assert "vime.supervisor.engine.fsm" in GRAPH["vime.supervisor.engine.runner"]
    assert any("vime.supervisor.client" in GRAPH[n] for n in GRAPH if n.startswith("vime.trainer."))
    assert layer("vime.supervisor.router.plan") == "router" and layer("vime.supervisor.router.feed") == "daemon"
    assert group("vime.supervisor.client.cli") == "client" and group("vime.supervisor.engine.fsm") == "engine"
    assert "vime.supervisor.router.plan" in GRAPH["vime.supervisor.router.feed"]


@pytest.mark.parametrize("name", sorted(MODULES))
def test_each_module_imports_only_what_its_layer_may(name):
    mine = layer(name)
    bad = sorted(t for t in GRAPH[name] if layer(t) not in ALLOWED[mine])
    assert not bad, f"{name} ({mine}) imports {bad}: see the import rule in docs/architecture.md"


def test_ray_is_imported_by_the_cluster_package_and_its_harness_only():
    # Ray is an optional extra: the daemon, the client and the trainer's code run without it.
    for name, path in MODULES.items():
        if name.startswith(("vime.cluster", "vime.harness")):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                    else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(m == "ray" or m.startswith("ray.") for m in mods), f"{name} imports Ray"


def test_no_import_cycle_among_the_daemons_modules():
    daemon = {n for n in MODULES if n.startswith("vime.supervisor")}
    seen: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(n: str, path: list[str]) -> None:
        seen[n] = 1
        for t in sorted(GRAPH[n] & daemon):
            if seen.get(t) == 1:
                cycle = path[path.index(t):] + [t]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if t not in seen:
                visit(t, path + [t])
        seen[n] = 2

    for n in sorted(daemon):
        if n not in seen:
            visit(n, [n])


def test_every_package_folder_is_reached_through_src():
    """src/vime/<folder> is a relative symlink to each card folder: the on-disk import path that
    setuptools' package discovery, an editable install and every static tool follow."""
    for folder in FOLDERS:
        link = ROOT / "src" / "vime" / folder
        assert link.is_symlink(), f"src/vime/{folder} must be a symlink to ../../{folder}"
        assert link.readlink() == Path("..", "..", folder), link.readlink()
        assert (link / "__init__.py").is_file(), folder
    assert (ROOT / "src" / "vime" / "__init__.py").is_file()
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "package-dir" not in cfg and cfg["packages"]["find"]["where"] == ["src"]


def test_every_module_imports_with_only_src_on_the_path():
    """No import hook: a fresh interpreter with src/ on sys.path, and neither the editable
    install's finder nor the repository root, imports every module of ours that needs no
    optional dependency to import."""
    import subprocess
    import sys

    names = sorted(MODULES)
    code = (
        "import sys, importlib\n"
        f"sys.path[:] = [{str(ROOT / 'src')!r}] + [p for p in sys.path if p.startswith(sys.base_prefix) or 'site-packages' in p]\n"
        "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in type(f).__module__.lower()]\n"
        "bad = []\n"
        f"for n in {names!r}:\n"
        "    try:\n"
        "        m = importlib.import_module(n)\n"
        f"        assert m.__file__.startswith({str(ROOT / 'src')!r}), (n, m.__file__)\n"
        "    except ModuleNotFoundError as e:\n"
        "        if e.name and e.name.split('.')[0] in ('vime',):\n"
        "            bad.append((n, repr(e)))\n"
        "print(len(sys.modules), bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    r = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, cwd="/")
    assert r.returncode == 0, r.stdout + r.stderr
    assert int(r.stdout.split()[0]) > len(names), r.stdout  # it did import them


# -- typed seams --------------------------------------------------------------------------------


def _is_any(annotation: ast.expr | None) -> bool:
    """`Any`, `typing.Any`, `Any | None`, `Optional[Any]` (or any of them quoted)."""
    if annotation is None:
        return False
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        try:
            annotation = ast.parse(annotation.value, mode="eval").body
        except SyntaxError:
            return False
    if isinstance(annotation, ast.Name):
        return annotation.id == "Any"
    if isinstance(annotation, ast.Attribute):
        return annotation.attr == "Any"
    if isinstance(annotation, ast.BinOp) and isinstance(annotation.op, ast.BitOr):
        sides = (annotation.left, annotation.right)
        return any(_is_any(x) for x in sides) and all(
            _is_any(x) or isinstance(x, ast.Constant) and x.value is None for x in sides)
    if isinstance(annotation, ast.Subscript) and getattr(annotation.value, "id", None) == "Optional":
        return _is_any(annotation.slice)
    return False


def any_attributes(tree: ast.Module) -> dict[str, str]:
    """attribute -> class, for the attributes a class of `tree` annotates `Any`: in its body
    (`x: Any`) or in a method (`self.x: Any = None`)."""
    out: dict[str, str] = {}
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for node in ast.walk(cls):
            if not isinstance(node, ast.AnnAssign) or not _is_any(node.annotation):
                continue
            t = node.target
            if isinstance(t, ast.Name) and node in cls.body:
                out[t.id] = cls.name
            elif isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                out[t.attr] = cls.name
    return out


def assigned_attributes(tree: ast.Module) -> set[str]:
    """Attributes `tree` assigns on an object other than its own `self` (`fleet.router = ...`)."""
    out: set[str] = set()
    for node in ast.walk(tree):
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
        for t in targets:
            for sub in ast.walk(t):
                if (isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store)
                        and not (isinstance(sub.value, ast.Name) and sub.value.id == "self")):
                    out.add(sub.attr)
    return out


def untyped_seams(sources: dict[str, str], graph: dict[str, set[str]], judged: set[str]) -> list[str]:
    """`module.Class.attr <- other` for each attribute a class of a `judged` module annotates
    `Any` that another module importing it assigns (matched by name: a false match is fixed
    by typing the attribute)."""
    trees = {name: ast.parse(text) for name, text in sources.items()}
    declared = {name: any_attributes(trees[name]) for name in judged}
    assigned = {name: assigned_attributes(tree) for name, tree in trees.items()}
    return sorted(f"{name}.{cls}.{attr} <- {other}"
                  for name, attrs in declared.items() for attr, cls in attrs.items()
                  for other in trees if name in graph.get(other, ()) and attr in assigned[other])


def test_an_any_attribute_assigned_from_another_module_is_found():
    # The rule below must be able to fail: the pattern it forbids, in two small modules.
    owner = "from typing import Any\nclass Fleet:\n    def __init__(self):\n        self.router: Any = None\n"
    wiring = "def wire(fleet, feed):\n    fleet.router = feed\n"
    graph = {"a": set(), "b": {"a"}}
    assert untyped_seams({"a": owner, "b": wiring}, graph, {"a"}) == ["a.Fleet.router <- b"]
    typed = owner.replace("router: Any", "router: 'RouterGate | None'")
    assert untyped_seams({"a": typed, "b": wiring}, graph, {"a"}) == []
    own_self = "def f(self):\n    self.router = 1\n"  # another class's attribute of that name
    assert untyped_seams({"a": owner, "b": own_self}, graph, {"a"}) == []


def test_no_seam_into_the_daemon_or_the_trainer_is_typed_any():
    """What one module wires into another's object is typed (a Protocol, as RestartGate and
    RouterGate, or a class): an `Any` slot set from outside is wiring mypy cannot see. Judged:
    the daemon's groups, its client and the trainer (the example loop), against every module of ours."""
    judged = {n for n in MODULES if group(n) in GROUPS or layer(n) in ("trainer", "client")}
    found = untyped_seams({name: path.read_text() for name, path in MODULES.items()}, GRAPH, judged)
    assert not found, f"type these attributes (a Protocol or a class), not Any: {found}"


# -- one adoption verdict -----------------------------------------------------------------------

ADOPTION = "vime.supervisor.engine.adoption"


def ownership_checks(tree: ast.Module) -> list[str]:
    """Where `tree` answers "is this pid ours?" itself: it reads a process's environment
    (/proc/PID/environ: SPAWN_MARK), asks for its session (os.getsid), takes over a pid through
    a pidfd (os.pidfd_open), or compares a process's group with its own pid (`st.pgrp != st.pid`)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.endswith("/environ"):
            found.append(f"line {node.lineno}: reads {node.value!r}")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os" \
                and node.attr in ("getsid", "pidfd_open"):
            found.append(f"line {node.lineno}: os.{node.attr}")
        elif isinstance(node, ast.Compare) and len(node.comparators) == 1:
            sides = [node.left, node.comparators[0]]
            if all(isinstance(x, ast.Attribute) for x in sides):
                attrs = {x.attr for x in sides if isinstance(x, ast.Attribute)}
                bases = {ast.dump(x.value) for x in sides if isinstance(x, ast.Attribute)}
                if attrs == {"pgrp", "pid"} and len(bases) == 1:
                    found.append(f"line {node.lineno}: compares a process's group with its pid")
    return found


def test_an_ownership_check_outside_the_verdict_is_found():
    # The rule below must be able to fail: each pattern it forbids, as routerchild.py,
    # process.py and daemon.py held them.
    src = ("def f(st, pid):\n"
           "    if st.pgrp != st.pid:\n        return False\n"
           "    open(f'/proc/{pid}/environ', 'rb')\n"
           "    return os.getsid(pid) == pid or os.pidfd_open(pid)\n")
    assert len(ownership_checks(ast.parse(src))) == 4
    assert ownership_checks(ast.parse("def g(st, pgid):\n    return st.pgrp == pgid\n")) == []  # membership


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n.startswith("vime.supervisor")))
def test_is_this_pid_ours_is_answered_in_one_module(name):
    """Engines and the spawned router are adopted, stopped or left alone by one verdict
    (engine/adoption.py): no other module of the daemon answers it its own way."""
    if name == ADOPTION:
        assert ownership_checks(ast.parse(MODULES[name].read_text())), "the verdict's checks moved: update this rule"
        return
    tree = ast.parse(MODULES[name].read_text())
    found = [f for f in ownership_checks(tree) if f not in own_child_pidfds(tree, name)]
    assert not found, f"{name} decides whether a process is ours: use engine/adoption.py's verdict ({found})"


def own_child_pidfds(tree: ast.Module, name: str) -> list[str]:
    """The one pidfd that answers no ownership question: ChildProcess.spawn's, opened on the
    child it has just forked (`os.pidfd_open(popen.pid)`) to see its exit, as an adopted one's is."""
    if name != "vime.supervisor.engine.process":
        return []
    return [f"line {n.func.lineno}: os.pidfd_open" for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "pidfd_open"
            and len(n.args) == 1 and ast.unparse(n.args[0]) == "popen.pid"]


# -- one routing rule ---------------------------------------------------------------------------

RULE = "vime.supervisor.states"  # VersionRule: which weight versions may serve
# The routing verdicts, each of which asks the rule (a call of `allows`) and compares no engine's
# weight version itself: the daemon's policy, publish, syncs and promotions, the state machine's
# entries into serving, the cluster's view and its publish (which compares the node daemon's own
# version, acknowledged or not: not an engine's, so it is judged on asking the rule only).
VERDICTS = {
    "vime.supervisor.policy": ("FleetPolicy.allows",),
    "vime.supervisor.fleet": ("Fleet._publish_weights",),
    "vime.supervisor.sync": ("SyncCoordinator.promote_spares", "SyncCoordinator.sync_spares",
                             "SyncCoordinator.consider", "SyncCoordinator._verify"),
    "vime.supervisor.engine.fsm": ("EngineFSM.became_ready", "EngineFSM.release", "EngineFSM.promote",
                                   "EngineFSM.recovered", "EngineFSM.relabelled"),
    "vime.cluster.view": ("ClusterView.routable",),
}
ASKS_ONLY = {"vime.cluster.client": ("AsyncClusterClient._unacknowledged_out",)}


def _is_version(node: ast.AST) -> bool:
    """A weight version read directly: x.weight_version, weight_version, e.get("weight_version"),
    e["weight_version"] (one passed to a call, as allows(r.weight_version), is not compared)."""
    if isinstance(node, ast.Name):
        return node.id == "weight_version"
    if isinstance(node, ast.Attribute):
        return node.attr == "weight_version"
    key = None
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" and node.args:
        key = node.args[0]
    elif isinstance(node, ast.Subscript):
        key = node.slice
    return isinstance(key, ast.Constant) and key.value == "weight_version"


def bound_applied(tree: ast.AST) -> list[str]:
    """Where `tree` applies the staleness bound itself: max_staleness in a comparison or in
    arithmetic."""
    return [f"line {n.lineno}" for n in ast.walk(tree)
            if (isinstance(n, ast.BinOp) or isinstance(n, ast.Compare)
                and not all(isinstance(op, (ast.In, ast.NotIn)) for op in n.ops))
            and any(isinstance(x, ast.Name) and x.id == "max_staleness"
                    or isinstance(x, ast.Attribute) and x.attr == "max_staleness" for x in ast.walk(n))]


def version_compared(tree: ast.AST) -> list[str]:
    """Where `tree` compares a weight version itself (==, !=, <, ... with one on a side); `is
    None` tests are not comparisons of versions."""
    return [f"line {n.lineno}" for n in ast.walk(tree)
            if isinstance(n, ast.Compare) and not all(isinstance(op, (ast.Is, ast.IsNot)) for op in n.ops)
            and any(_is_version(x) for x in (n.left, *n.comparators))]


def function(tree: ast.Module, qualname: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    cls, _, fn = qualname.rpartition(".")
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == fn:
                    return item
    return None


def asks_the_rule(fn: ast.AST) -> bool:
    """A call of `allows` (the rule's, or the fleet policy's that asks it), or of a local name
    bound to it."""
    return any(isinstance(n, ast.Call) and (isinstance(n.func, ast.Attribute) and n.func.attr == "allows"
                                            or isinstance(n.func, ast.Name) and n.func.id == "allows")
               for n in ast.walk(fn))


def test_a_second_copy_of_the_routing_rule_is_found():
    # The checks below must be able to fail: the comparisons the verdicts held before the rule.
    src = ("def routable(self, e, r):\n"
           "    return e.get('weight_version') == self.weight_version or r.weight_version != 3\n"
           "def allowed(v, cur, max_staleness):\n    return cur - v <= max_staleness\n")
    tree = ast.parse(src)
    assert version_compared(tree) == ["line 2", "line 2"] and bound_applied(tree) == ["line 4"]
    assert not asks_the_rule(tree)
    assert version_compared(ast.parse("x = r.weight_version is None or allows(r.weight_version) == ok\n")) == []
    assert bound_applied(ast.parse("ok = 'max_staleness' in table\n")) == []


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n.startswith(("vime.supervisor", "vime.cluster",
                                                                             "vime.trainer"))))
def test_the_staleness_bound_is_applied_by_the_rule_alone(name):
    found = bound_applied(ast.parse(MODULES[name].read_text()))
    if name == RULE:
        assert found, "the rule's bound moved: update this check"
        return
    assert not found, f"{name} applies max_staleness itself: ask states.VersionRule ({found})"


@pytest.mark.parametrize("name, qualname, strict", [(m, q, True) for m, qs in VERDICTS.items() for q in qs]
                         + [(m, q, False) for m, qs in ASKS_ONLY.items() for q in qs])
def test_each_routing_verdict_asks_the_one_rule(name, qualname, strict):
    fn = function(ast.parse(MODULES[name].read_text()), qualname)
    assert fn is not None, f"{name}.{qualname} moved: update VERDICTS"
    assert asks_the_rule(fn), f"{name}.{qualname} decides routing without states.VersionRule.allows"
    found = version_compared(fn) if strict else []
    assert not found, f"{name}.{qualname} compares weight versions itself: ask the rule ({found})"


def test_no_two_test_modules_share_a_basename():
    # pytest imports test modules by basename (rootdir-relative, no __init__.py in tests/): two
    # tests/*/test_x.py make a whole-suite run stop at collection while each folder alone passes.
    seen: dict[str, list[str]] = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}
