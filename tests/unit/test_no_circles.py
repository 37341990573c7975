"""No import circle among the modules of one folder, and no `_private` name taken from a sibling.

Read from the source (every import statement, those under TYPE_CHECKING and inside functions
included): a circle is one even when Python happens to resolve it at run time, and a private
name imported by a sibling is a name two modules share without saying so; either is fixed by
moving the shared part, public, into a module both import.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# folder -> its import name; bench/ is scripts run with bench/ on sys.path (`import completion`).
FOLDERS = {"supervisor": "vime.supervisor", "trainer": "vime.trainer", "weight_sync": "vime.weight_sync",
           "harness": "vime.harness", "cluster": "vime.cluster", "bench": ""}


def folders() -> Iterator[tuple[Path, str]]:
    """Every folder of ours holding modules, with its package name ("" for bench/)."""
    for top, package in FOLDERS.items():
        for d in sorted(p for p in [ROOT / top, *(ROOT / top).rglob("*")] if p.is_dir()):
            if any(d.glob("*.py")) and "__pycache__" not in d.parts:
                rel = d.relative_to(ROOT / top).parts
                yield d, ".".join([package, *rel]) if package else ".".join(rel)


def sibling_imports(folder: Path, package: str) -> Iterator[tuple[str, str, list[str]]]:
    """(module, sibling module it imports, the names it takes from it) for each import of a
    module of `folder` by another; a package's `__init__` is the module "__init__"."""
    siblings = {p.stem for p in folder.glob("*.py")}
    for path in sorted(folder.glob("*.py")):
        me = path.stem
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    name = alias.name
                    if package and name.startswith(package + "."):
                        head = name[len(package) + 1:].split(".")[0]
                    elif not package:
                        head = name.split(".")[0]
                    else:
                        continue
                    if head in siblings and head != me:
                        yield me, head, []
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: resolved against this folder
                    if node.level > 1:
                        continue  # a parent folder's module: not a sibling
                    mod = node.module or ""
                elif package and (node.module or "").startswith(package + "."):
                    mod = (node.module or "")[len(package) + 1:]
                elif package and node.module == package:
                    mod = ""
                elif not package and node.module:
                    mod = node.module
                else:
                    continue
                names = [a.name for a in node.names]
                if not mod:  # `from . import x` / `from pkg import x`: x a module, or a name of __init__
                    for n in names:
                        if n in siblings and n != me:
                            yield me, n, []
                        elif me != "__init__" and "__init__" in siblings:
                            yield me, "__init__", [n]
                    continue
                head = mod.split(".")[0]
                if head in siblings and head != me:
                    yield me, head, names if "." not in mod else []


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_reader_sees_every_folder_and_import():
    """Guards the checks below against reading nothing: every folder is found, and a known
    import of a sibling (rollout's client uses its continuation half) is seen."""
    seen = {package for _, package in folders()}
    assert {"vime.supervisor", "vime.supervisor.engine", "vime.supervisor.client", "vime.trainer",
            "vime.weight_sync", "vime.harness", "vime.cluster", ""} <= seen
    trainer = [(a, b) for a, b, _ in sibling_imports(ROOT / "trainer", "vime.trainer")]
    assert ("rollout", "continuation") in trainer


def test_the_circle_finder_finds_circles():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_inside_a_folder():
    found = []
    for folder, package in folders():
        edges: dict[str, set[str]] = {}
        for a, b, _ in sibling_imports(folder, package):
            edges.setdefault(a, set()).add(b)
        for comp in circles(edges):
            found.append(f"{folder.relative_to(ROOT)}: {' <-> '.join(comp)}")
    assert not found, ("import circles (move what the modules share, public, into a module both "
                       "import):\n" + "\n".join(found))


def test_no_private_name_imported_from_a_sibling():
    found = []
    for folder, package in folders():
        for a, b, names in sibling_imports(folder, package):
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private:
                found.append(f"{folder.relative_to(ROOT)}/{a}.py takes {', '.join(private)} from {b}")
    assert not found, ("private names crossing modules (make them public where they are shared, or "
                       "move them):\n" + "\n".join(found))
