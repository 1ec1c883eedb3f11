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
