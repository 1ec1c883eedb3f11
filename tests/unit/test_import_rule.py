"""The pure cores stay pure: importing one pulls in no Kafka client, no HTTP client, no config.

Each module is imported in a fresh interpreter with a meta-path hook that notes, for every
forbidden module, the chain of modules that were executing when it was first imported
(``services.inference.core -> services.common.kafka -> aiokafka``), so a failure names
the import to remove rather than only the module that leaked.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

FORBIDDEN = ("aiokafka", "httpx", "aiohttp", "services.common.config")

# Runs in the child: argv[1] is the module to import, argv[2:] the forbidden names.
_CHILD = r"""
import importlib, json, sys

target, forbidden = sys.argv[1], tuple(sys.argv[2:])
already = sorted(n for n in sys.modules if any(n == f or n.startswith(f + ".") for f in forbidden))
chains = {}

def chain(name):
    names = []
    frame = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__", "?")
        if not module.startswith(("importlib", "_frozen_importlib")) and module != "__main__":
            names.append(module)
        frame = frame.f_back
    names.reverse()
    deduped = [n for i, n in enumerate(names) if i == 0 or names[i - 1] != n]
    return deduped + [name]

class Watch:
    def find_spec(self, name, path=None, target=None):
        for f in forbidden:
            if (name == f or name.startswith(f + ".")) and f not in chains:
                chains[f] = chain(name)
        return None  # the ordinary finders do the import

sys.meta_path.insert(0, Watch())
importlib.import_module(target)
loaded = sorted(f for f in forbidden if any(n == f or n.startswith(f + ".") for n in sys.modules))
print(json.dumps({"already": already, "loaded": loaded, "chains": chains}))
"""


def _package(name: str) -> list[str]:
    """A package and each of its modules."""
    folder = REPO.joinpath(*name.split("."))
    return [name] + [f"{name}.{p.stem}" for p in sorted(folder.glob("*.py")) if p.stem != "__init__"]


def _pure_modules() -> list[str]:
    """Every stage core, the profiles package and the schemas package, found on disk."""
    cores = [f"services.{p.parent.name}.core" for p in sorted((REPO / "services").glob("*/core.py"))]
    return [*cores, "services.common.records", *_package("services.profiles"), *_package("schemas")]


PURE = _pure_modules()


def imports_of(module: str) -> dict[str, object]:
    """Import ``module`` in a fresh interpreter; which forbidden modules it loaded, and through what."""
    done = subprocess.run(  # noqa: S603 - our own interpreter and a fixed script
        [sys.executable, "-c", _CHILD, module, *FORBIDDEN],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, f"importing {module} failed:\n{done.stderr}"
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_every_core_is_found() -> None:
    cores = [m for m in PURE if m.endswith(".core")]
    assert {"services.inference.core", "services.audit.core", "services.dlq.core"} <= set(cores)
    assert len(cores) >= 10, cores


@pytest.mark.parametrize("module", PURE)
def test_pure_module_imports_no_client_and_no_config(module: str) -> None:
    found = imports_of(module)
    assert found["already"] == [], f"loaded before {module} was imported (site or .pth): {found['already']}"
    chains = found["chains"]
    assert isinstance(chains, dict)
    described = "; ".join(" -> ".join(c) for c in chains.values())
    assert found["loaded"] == [], f"{module} imports {found['loaded']}: {described}"


def test_the_hook_names_the_chain_of_a_leak() -> None:
    """The check can fail: the Kafka plumbing does import aiokafka and the config, and the chain says how."""
    found = imports_of("services.common.kafka")
    assert found["loaded"] == ["aiokafka", "services.common.config"]
    chains = found["chains"]
    assert isinstance(chains, dict)
    assert chains["aiokafka"][:2] == ["services.common.kafka", "aiokafka"]
    assert chains["services.common.config"][0] == "services.common.kafka"


# --- which way the house's imports run --------------------------------------------------------
#
# schemas is the floor: it imports nothing of services. services/common is below every stage and
# below the CLI: it imports neither (a runner is handed its settings, a command registry is not
# imported). services.cli, the root command, is the roof: nothing imports it. A stage's CLI
# imports its own stage and the shared modules (services.common, services.profiles,
# services.control), never another stage: what one command needs from another stage is wired by
# services.cli into click's context (services.common.cli.Hooks: publish --dry-run's pricing from
# the estimate stage, the probe the inference worker runs).

SERVICES = REPO / "services"
STAGES = tuple(
    sorted(
        p.name
        for p in SERVICES.iterdir()
        if p.name != "common" and ((p / "app.py").exists() or (p / "cli.py").exists())
    )
)


def imported_modules(path: Path, root: Path | None = None) -> list[tuple[int, str]]:
    """(line, module) of every import in ``path`` (under ``root``, default the repository), at any
    depth (functions, TYPE_CHECKING blocks)."""
    import ast

    package = ".".join(path.relative_to(root or REPO).with_suffix("").parts[:-1])
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, *([base] if base else [])])
            # `from services import cli` imports services.cli: name both the package and the member.
            found += [(node.lineno, base)] + [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def upward_imports(path: Path) -> list[str]:
    """The imports of ``path`` that run the wrong way (see above), as ``file:line: module``."""
    where = path.relative_to(REPO)
    if where.parts[0] == "schemas":
        banned = ["services"]
    elif where.parts[:2] == ("services", "common"):
        banned = ["services.cli", *(f"services.{s}" for s in STAGES)]
    elif where.name == "cli.py" and len(where.parts) == 3 and where.parts[1] in STAGES:
        banned = ["services.cli", *(f"services.{s}" for s in STAGES if s != where.parts[1])]
    elif where.parts[0] == "services" and where != Path("services", "cli.py"):
        banned = ["services.cli"]
    else:
        return []
    first: dict[int, str] = {}  # one finding per import statement: its first wrong module
    for line, module in imported_modules(path):
        if any(_under(module, b) for b in banned):
            first.setdefault(line, module)
    return [f"{where}:{line}: {module}" for line, module in sorted(first.items())]


def test_the_stages_are_found() -> None:
    assert {"publish", "estimate", "inference", "audit", "sink", "status", "dlq"} <= set(STAGES)
    assert "common" not in STAGES and "profiles" not in STAGES


def test_common_imports_no_stage_and_no_cli_and_no_stage_cli_imports_another_stage() -> None:
    files = [*sorted(SERVICES.rglob("*.py")), *sorted((REPO / "schemas").rglob("*.py"))]
    assert len(files) > 100
    wrong = [line for path in files for line in upward_imports(path)]
    assert wrong == [], "imports that run up the house:\n" + "\n".join(wrong)


def test_the_direction_check_can_fail(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check sees an import at any depth, relative or absolute, and under TYPE_CHECKING."""
    fake = tmp_path / "services"
    (fake / "common").mkdir(parents=True)
    (fake / "publish").mkdir()
    (fake / "common" / "runner.py").write_text(
        "def run():\n    from services.cli import settings_from\n    from .. import audit\n"
    )
    (fake / "publish" / "cli.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from services.estimate.core import X\n"
        "from services.common import console\nfrom services.publish import app\n"
        "def run():\n    from services.cli import fail\n"
    )
    (fake / "publish" / "app.py").write_text("from services.common.cli import fail\nfrom services import cli\n")
    (tmp_path / "schemas").mkdir()
    (tmp_path / "schemas" / "wire.py").write_text("import msgspec\nfrom services.common.records import DeadLetter\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    assert upward_imports(fake / "common" / "runner.py") == [
        "services/common/runner.py:2: services.cli", "services/common/runner.py:3: services.audit"
    ]
    assert upward_imports(fake / "publish" / "cli.py") == [
        "services/publish/cli.py:3: services.estimate.core", "services/publish/cli.py:7: services.cli"
    ]
    assert upward_imports(fake / "publish" / "app.py") == ["services/publish/app.py:2: services.cli"]
    assert upward_imports(tmp_path / "schemas" / "wire.py") == ["schemas/wire.py:2: services.common.records"]


# --- no circles ---------------------------------------------------------------------------------
#
# Two modules that import each other, at any depth (a lazy import in a function or one under
# TYPE_CHECKING counts too), are one job split in two or a third module missing.


def module_files(root: Path) -> dict[str, Path]:
    """Every module of services/ and schemas/ under ``root`` by dotted name (a package by its own)."""
    found: dict[str, Path] = {}
    for top in ("services", "schemas"):
        for path in sorted((root / top).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module → the modules of the house it imports (``from pkg import mod`` names ``pkg`` and ``pkg.mod``)."""
    files = module_files(root)

    def known(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        targets: set[str] = set()
        for _, module in imported_modules(path, root):
            target = known(module)
            if target is not None and target != name:
                targets.add(target)
        graph[name] = targets
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component: list[str] = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def test_no_two_modules_import_each_other() -> None:
    graph = import_graph(REPO)
    assert len(graph) > 100 and "services.common.cli" in graph["services.cli"]
    assert circles(graph) == [], "modules in a circle of imports: " + "; ".join(" <-> ".join(c) for c in circles(graph))


def test_the_circle_check_can_fail(tmp_path: Path) -> None:
    """A lazy import back, a relative one, and a package re-exporting a module that imports it, all close circles."""
    services = tmp_path / "services"
    (services / "inference").mkdir(parents=True)
    (services / "probe").mkdir()
    (services / "profiles").mkdir()
    (tmp_path / "schemas").mkdir()
    (tmp_path / "schemas" / "__init__.py").write_text("")
    (services / "__init__.py").write_text("")
    (services / "inference" / "app.py").write_text("def start():\n    from services.probe.app import probe_first\n")
    (services / "probe" / "app.py").write_text("from ..inference import app\n")
    (services / "profiles" / "__init__.py").write_text("from services.profiles.spec import Profile\n")
    (services / "profiles" / "spec.py").write_text("from services.profiles import loading\n")
    (services / "profiles" / "loading.py").write_text("import schemas\n")
    assert circles(import_graph(tmp_path)) == [
        ["services.inference.app", "services.probe.app"],
        ["services.profiles", "services.profiles.spec"],
    ]
