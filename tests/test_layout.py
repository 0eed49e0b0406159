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

DISTILL_ROOMS = {"store": 1, "labelling": 2, "training": 2, "calibration": 3, "loop": 4, "reports": 4,
                 "demo": 5, "rayserve": 5, "cli": 6}
"""distill's rooms, lowest first, by the same rule: the top-level modules (options, stopping) import
no room; the label store is under everything; labelling and training never meet; calibration
certifies what training made (and reads its split); the traffic loop retrains and calibrates, the
reports draw a calibration; the demo runs the whole flow; the Ray Serve config places the
server's replicas (which are the serve command's, so they live with it); the command line calls
them all."""


def _rooms_of(package: str, rooms: dict[str, int]) -> dict[str, tuple[str, int]]:
    """Each module of ``package`` (a room's ``__init__`` too) with its room and floor."""
    placed = {}
    for path in _modules(package):
        parts = path.relative_to(ROOT / package).parts
        room = parts[0] if len(parts) > 1 else "top"
        placed[_module_name(path)] = (room, rooms.get(room, 0))
    if package == "cascade":
        placed["cascade"] = ("the public surface", len(rooms) + 1)  # re-exports from every room
    return placed


def _upward_imports(package: str, rooms: dict[str, int]) -> list[str]:
    placed = _rooms_of(package, rooms)
    wrong = []
    for path in _modules(package):
        name = _module_name(path)
        room, floor = placed[name]
        for other in sorted(_imported(path) & set(placed)):
            other_room, other_floor = placed[other]
            if other_room != room and other_floor >= floor:
                wrong.append(f"{name} ({room}) imports {other} ({other_room})")
    return wrong


def _room_names(package: str) -> set[str]:
    return {p.name for p in (ROOT / package).iterdir() if (p / "__init__.py").is_file()}


def test_rooms_import_only_rooms_below_them() -> None:
    assert set(ROOMS) == _room_names("cascade")
    assert _upward_imports("cascade", ROOMS) == []


def test_distill_rooms_import_only_rooms_below_them_with_the_command_line_on_top() -> None:
    assert set(DISTILL_ROOMS) == _room_names("distill")
    assert max(DISTILL_ROOMS.values()) == DISTILL_ROOMS["cli"] > max(
        floor for room, floor in DISTILL_ROOMS.items() if room != "cli")
    assert _upward_imports("distill", DISTILL_ROOMS) == []


def test_every_room_says_what_it_is_for() -> None:
    empty = [str(init.relative_to(ROOT)) for package in ("cascade", "distill")
             for init in sorted((ROOT / package).glob("*/__init__.py"))
             if not ast.get_docstring(ast.parse(init.read_text(encoding="utf-8")))]
    assert empty == []


def test_every_old_distill_path_is_a_shim_to_a_module_that_exists() -> None:
    from distill._moved import MOVED, PACKAGE_NAMES

    for old, new in MOVED.items():
        shim = ROOT.joinpath(*old.split(".")).with_suffix(".py")
        assert shim.read_text(encoding="utf-8").endswith("\nalias(__name__)\n"), old
        assert ROOT.joinpath(*new.split(".")).with_suffix(".py").is_file(), new
    shims = {_module_name(path) for path in _modules("distill")
             if path.read_text(encoding="utf-8").endswith("\nalias(__name__)\n")}
    assert shims == set(MOVED)
    for package, (home, _names) in PACKAGE_NAMES.items():
        assert ROOT.joinpath(*package.split("."), "__init__.py").is_file(), package
        assert ROOT.joinpath(*home.split(".")).with_suffix(".py").is_file(), home


def test_an_old_distill_path_still_imports_warns_and_is_the_new_module() -> None:
    """For one release: the old module name is the new module itself (its private names and what
    a test patches on it included), and the warning names the new path and points at the import."""
    code = ("import warnings\nwith warnings.catch_warnings(record=True) as caught:\n"
            "    warnings.simplefilter('always')\n"
            "    import distill.label_transfer as old\n"
            "    from distill import report_figures\n"
            "    from distill.cli.serve_upstream import add_upstream_arguments\n"
            "    from distill.demo import DemoConfig\n"
            "import distill.cli.serve.upstream, distill.demo.run, distill.labelling.transfer as new\n"
            "import distill.reports.figures\n"
            "assert old is new and old.__name__ == 'distill.labelling.transfer', old\n"
            "assert old._write_pending is new._write_pending\n"
            "assert report_figures is distill.reports.figures\n"
            "assert add_upstream_arguments is distill.cli.serve.upstream.add_upstream_arguments\n"
            "assert DemoConfig is distill.demo.run.DemoConfig\n"
            "for w in caught:\n    print(w.category.__name__, w.filename, w.message, sep='|')")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    warned = [line.split("|") for line in done.stdout.splitlines()]
    assert [(category, where) for category, where, _ in warned] == [("DeprecationWarning", "<string>")] * 4
    for (_, _, message), new in zip(warned, ("distill.labelling.transfer", "distill.reports.figures",
                                              "distill.cli.serve.upstream", "distill.demo.run.DemoConfig"),
                                     strict=True):
        assert f"moved to {new};" in message, message


def test_no_repository_module_imports_an_old_distill_path() -> None:
    """The old paths are for code outside the repository: inside it, every import is the new one."""
    from distill._moved import MOVED, PACKAGE_NAMES

    old = set(MOVED) | {f"{package}.{name}" for package, (_, names) in PACKAGE_NAMES.items()
                        for name in names}
    paths = [path for folder in ("cascade", "distill", "tests", "bench", "examples")
             for path in sorted((ROOT / folder).rglob("*.py"))]
    using = {str(path.relative_to(ROOT)): sorted(_imported(path) & old) for path in paths}
    assert paths and {path: names for path, names in using.items() if names} == {}
