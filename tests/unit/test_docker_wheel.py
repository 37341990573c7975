"""The Docker image installs a wheel built from exactly the files its Dockerfile copies. The image
itself cannot be built on these machines (its base, vllm/vllm-openai, is not reachable), so this
builds that wheel from those files alone and checks it holds every package and module of ours."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def copied_paths(dockerfile: Path) -> list[str]:
    """The sources of every COPY line (no --from: none of ours copies from another stage)."""
    out: list[str] = []
    for line in dockerfile.read_text().splitlines():
        if not line.upper().startswith("COPY "):
            continue
        words = shlex.split(line.split("#", 1)[0])
        if words:
            args = [w for w in words[1:] if not w.startswith("--")]
            assert not any(w.startswith("--from") for w in words), line
            out += args[:-1]
    return out


def test_copied_paths_are_read_from_the_dockerfile():
    paths = copied_paths(ROOT / "Dockerfile")
    assert "pyproject.toml" in paths and "src" in paths


def test_the_wheel_builds_from_exactly_the_dockerfiles_files(tmp_path):
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    for rel in copied_paths(ROOT / "Dockerfile"):
        src = ROOT / rel
        assert src.exists() or src.is_symlink(), f"the Dockerfile copies {rel}, which does not exist"
        if src.is_dir() and not src.is_symlink():
            # COPY keeps symlinks as links, as copytree(symlinks=True) does
            shutil.copytree(src, ctx / rel, symlinks=True,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(src, ctx / rel, follow_symlinks=False)
    dist = tmp_path / "dist"
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                        "--quiet", "-w", str(dist), str(ctx)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    (wheel,) = dist.glob("vime_supervisor-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    # every module of the source tree is in the wheel under vime/
    expected = {"vime/" + str(p.relative_to(ROOT / "src" / "vime"))
                for p in (ROOT / "src" / "vime").rglob("*.py") if "__pycache__" not in p.parts}
    assert expected and expected <= names, sorted(expected - names)
    assert "vime/supervisor/py.typed" in names and "vime/supervisor/client/py.typed" in names
    # the operators' files (deploy/): alert rules, dashboard, manifests
    deploy = {"vime/" + str(p.relative_to(ROOT)) for p in (ROOT / "deploy").rglob("*")
              if p.suffix in (".yml", ".yaml", ".json")}
    assert "vime/deploy/prometheus/vime-alerts.yml" in deploy and deploy <= names, sorted(deploy - names)
