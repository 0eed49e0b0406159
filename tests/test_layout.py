"""The package layout the design promises: the runtime never imports the offline package, and no
module grows past what a reader takes in at once."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 520
"""About 500 lines: the largest module of a library worth imitating (model2vec) is 561."""


def _modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def _imported(path: Path) -> set[str]:
    """Every module name an import statement in ``path`` names, at any depth (lazy ones too)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)  # and each name as a submodule: ``from distill import student``
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_the_runtime_never_imports_the_offline_package() -> None:
    offenders = {str(path.relative_to(ROOT)): sorted(name for name in _imported(path)
                                                     if name.split(".")[0] == "distill")
                 for path in _modules("cascade")}
    assert _modules("cascade") and {path: names for path, names in offenders.items() if names} == {}


def test_every_runtime_module_imports_with_the_offline_package_unimportable() -> None:
    """A user who only routes needs none of ``distill``: here it cannot be imported at all."""
    modules = [".".join(path.relative_to(ROOT).with_suffix("").parts) for path in _modules("cascade")]
    code = ("import importlib, sys\nsys.modules['distill'] = None  # any import of it now fails\n"
            f"for name in {modules!r}:\n    importlib.import_module(name.removesuffix('.__init__'))\n"
            "print(len(sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr


def test_no_module_is_longer_than_about_500_lines() -> None:
    lengths = {str(path.relative_to(ROOT)): len(path.read_text(encoding="utf-8").splitlines())
               for package in ("cascade", "distill") for path in _modules(package)}
    assert {path: n for path, n in lengths.items() if n > MAX_LINES} == {}


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _import_cycles() -> list[list[str]]:
    """Cycles of the graph "module imports module" over the project's modules, lazy imports too:
    a lazy import still ties the two modules into one that neither can be read without."""
    paths = {_module_name(path): path for package in ("cascade", "distill") for path in _modules(package)}
    graph = {name: sorted(_imported(path) & set(paths) - {name}) for name, path in paths.items()}
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for other in graph[name]:
            if state.get(other) == 1:
                cycles.append([*path[path.index(other):], other])
            elif other not in state:
                visit(other, [*path, other])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    return cycles


def test_no_two_modules_import_each_other() -> None:
    assert _import_cycles() == []


def test_the_public_surface_imports_every_name_it_lists_without_loading_models() -> None:
    """``from cascade import Cascade, ...``: every listed name resolves; ``import cascade`` alone
    starts neither llama.cpp nor ONNX Runtime (the command line's --help stays fast)."""
    code = ("import sys, cascade\nheavy = [m for m in ('llama_cpp', 'onnxruntime') if m in sys.modules]\n"
            "assert not heavy, heavy\nassert sorted(cascade.__all__) == sorted(cascade._HOMES)\n"
            "for name in cascade.__all__:\n    assert getattr(cascade, name) is not None, name\n"
            "from cascade import Budget, Cascade, parse_request\nprint(Cascade.__module__)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "cascade.routing.router"


ROOMS = {"readout": 1, "encoder": 1, "cost": 2, "teachers": 2, "tiers": 3, "collect": 3, "bundle": 4,
         "routing": 5, "audit": 6, "serve": 7}
"""cascade's rooms, lowest first: a room imports only rooms below it and the top-level modules
(wire types, errors, heads, thresholds), which import no room. Two rooms of one floor never meet."""


def _room(module: str) -> tuple[str, int]:
    if module == "cascade":
        return "the public surface", len(ROOMS) + 1  # re-exports from every room
    parts = module.split(".")
    room = parts[1] if len(parts) > 2 else "top"
    return room, ROOMS.get(room, 0)


def test_rooms_import_only_rooms_below_them() -> None:
    paths = {_module_name(path): path for path in _modules("cascade")}
    wrong = []
    for name, path in paths.items():
        room, floor = _room(name)
        for other in sorted(_imported(path) & set(paths)):
            other_room, other_floor = _room(other)
            if other_room != room and other_floor >= floor:
                wrong.append(f"{name} ({room}) imports {other} ({other_room})")
    assert set(ROOMS) == {p.name for p in (ROOT / "cascade").iterdir() if (p / "__init__.py").is_file()}
    assert wrong == []
