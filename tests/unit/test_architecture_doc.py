"""docs/architecture.md checked against the code it describes.

The group list names every module of the daemon's folder under the group (or layer) that
tests/unit/test_layout.py gives it, and names nothing the code lacks. The object graph names
what the composition root builds: each attribute `Supervisor.__init__` (and the router's owner,
`RouterLink`) assigns from a class of ours, as `attr: Class (path)`, and each class of ours their
other methods build (the runners, the control and metrics servers).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from test_layout import MODULES, group

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
DAEMON = ROOT / "supervisor"
# The composition root and the owner it hands the router to: (file under supervisor/, class).
ROOTS = [("daemon.py", "Supervisor"), ("router/link.py", "RouterLink")]


def code_blocks(text: str) -> list[str]:
    return re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.S)


def doc_groups(text: str) -> dict[str, str]:
    """The module -> group map of the doc's group list: the code block whose first word is `base`.

    A line starts with its group's name (an indented line continues the one above); `folder/:`
    opens a sub-package for the names after it (up to a `;` or the next group), `__init__` is the
    package itself,
    and `(...)` is a remark."""
    block = next((b for b in code_blocks(text) if b.split(None, 1)[:1] == ["base"]), None)
    assert block is not None, "architecture.md lost its group list (a code block starting with `base`)"
    found: dict[str, str] = {}
    name = prefix = ""
    for line in block.splitlines():
        if not line.strip():
            continue
        if not line[0].isspace():
            name, line, prefix = line.split(None, 1)[0], line.split(None, 1)[1], ""
        line = re.sub(r"\([^)]*\)", "", line)
        for i, part in enumerate(line.split(";")):
            prefix = "" if i else prefix
            for item in (i.strip() for i in part.split(",")):
                if "/:" in item:
                    prefix, item = (s.strip() for s in item.split("/:", 1))
                if not item:
                    continue
                assert re.fullmatch(r"\w+", item), f"group list: {item!r} is not a module name"
                module = ".".join(["vime.supervisor", *([prefix] if prefix else []),
                                   *([] if item == "__init__" else [item])])
                assert module not in found, f"group list names {module} twice"
                found[module] = name
    return found


def object_graph(text: str) -> str:
    block = next((b for b in code_blocks(text) if b.startswith("Supervisor")), None)
    assert block is not None, "architecture.md lost its object graph (a code block starting with `Supervisor`)"
    return block


def our_classes(tree: ast.Module, here: str) -> dict[str, str]:
    """The classes a module imports from ours (a capitalised name from a relative import), each
    with its file's path under supervisor/."""
    package = Path(here).parent.parts
    out: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level:
            base = list(package[: len(package) - (node.level - 1)])
            parts = base + (node.module.split(".") if node.module else [])
            for alias in node.names:
                if alias.name[:1].isupper():
                    out[alias.asname or alias.name] = "/".join(parts) + ".py"
    return out


def built(here: str, cls: str) -> tuple[set[tuple[str, str, str]], set[tuple[str, str]]]:
    """What class `cls` of supervisor/`here` builds: ({(attribute, Class, path)} for each
    `self.attribute = Class(...)`, {(Class, path)} for each other instance of ours it makes)."""
    tree = ast.parse((DAEMON / here).read_text())
    ours = our_classes(tree, here)
    klass = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    raised = {id(n.exc) for n in ast.walk(klass) if isinstance(n, ast.Raise) and n.exc is not None}

    def made(value: ast.expr | None) -> str | None:
        if isinstance(value, ast.IfExp):  # `Link(...) if cfg.router else None`
            return made(value.body) or made(value.orelse)
        if (isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id in ours
                and id(value) not in raised):
            return value.func.id
        return None

    attrs: set[tuple[str, str, str]] = set()
    assigned: set[int] = set()
    for node in ast.walk(klass):
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        for target in targets:
            if (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                    and target.value.id == "self" and (c := made(value))):
                attrs.add((target.attr, c, ours[c]))
                assigned.update(id(n) for n in ast.walk(value))
    others = {(c, ours[c]) for n in ast.walk(klass)
              if isinstance(n, ast.Call) and id(n) not in assigned and (c := made(n))}
    return attrs, others


def test_the_group_list_names_every_module_of_the_daemon_under_its_group():
    doc = doc_groups(DOC.read_text())
    code = {n: group(n) for n in MODULES if n.startswith("vime.supervisor")}
    missing = sorted(f"{n} ({g})" for n, g in code.items() if n not in doc)
    assert not missing, f"docs/architecture.md's group list lacks {missing}"
    gone = sorted(n for n in doc if n not in code)
    assert not gone, f"docs/architecture.md's group list names modules the code lacks: {gone}"
    moved = sorted(f"{n}: doc {doc[n]}, code {code[n]}" for n in doc if doc[n] != code[n])
    assert not moved, f"docs/architecture.md's group list puts modules in the wrong group: {moved}"


def test_the_object_graph_names_what_the_composition_root_builds():
    graph = object_graph(DOC.read_text())
    absent = []
    for here, cls in ROOTS:
        attrs, others = built(here, cls)
        absent += [f"{a}: {c} ({p})" for a, c, p in sorted(attrs)
                   if not re.search(rf"(?<![\w.]){re.escape(a)}: {c} \({re.escape(p)}\)", graph)]
        absent += [f"{c} ({p})" for c, p in sorted(others) if not re.search(rf"\b{c} \({re.escape(p)}[,)]", graph)]
    assert not absent, f"docs/architecture.md's object graph lacks {absent}"


def test_the_checks_see_what_they_judge():
    # A parser that found nothing would pass both checks above.
    attrs, others = built("daemon.py", "Supervisor")
    assert {("fleet", "Fleet", "fleet.py"), ("router", "RouterLink", "router/link.py"),
            ("pushes", "PushCoordinator", "sync.py")} <= attrs
    assert {("ControlServer", "control.py"), ("EngineRunner", "engine/runner.py")} <= others
    link, _ = built("router/link.py", "RouterLink")
    assert {("child", "RouterChild", "router/child.py"), ("feed", "RouterFeed", "router/feed.py")} <= link
    groups = doc_groups(DOC.read_text())
    assert groups["vime.supervisor.engine.fsm"] == "engine" and groups["vime.supervisor.router.feed"] == "fleet"
    assert groups["vime.supervisor"] == "service" and groups["vime.supervisor.router.plan"] == "router"
    sample = "base     a, b\n         c\nfleet    d, router/: e,\n         f\nclient   client/: __init__; g (h, i)\n"
    assert doc_groups(f"```\n{sample}```") == {
        "vime.supervisor.a": "base", "vime.supervisor.b": "base", "vime.supervisor.c": "base",
        "vime.supervisor.d": "fleet", "vime.supervisor.router.e": "fleet", "vime.supervisor.router.f": "fleet",
        "vime.supervisor.client": "client", "vime.supervisor.g": "client"}
