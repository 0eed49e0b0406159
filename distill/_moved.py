"""The module paths ``distill`` had before it was grouped by concern, kept for one release.

Each old path is a module of three lines that calls ``alias(__name__)``: importing it warns (a
``DeprecationWarning`` naming the new path, attributed to the import that used the old one) and
makes the old name the new module itself, so its private names, and anything patched on it, are
the new module's. Nothing in the repository imports an old path (``tests/test_layout.py``
checks); the next release deletes them, and this module.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from types import FrameType, ModuleType

MOVED = {
    "distill.label": "distill.labelling.gguf",
    "distill.label_ray": "distill.labelling.on_ray",
    "distill.label_endpoint": "distill.labelling.endpoint",
    "distill.label_transfer": "distill.labelling.transfer",
    "distill.selection": "distill.labelling.selection",
    "distill.teachers": "distill.labelling.teachers",
    "distill.train": "distill.training.run",
    "distill.finetune": "distill.training.finetune",
    "distill.finetune_base": "distill.training.finetune_base",
    "distill.student": "distill.training.student",
    "distill.onnx_export": "distill.training.onnx_export",
    "distill.head_rule": "distill.training.head_rule",
    "distill.split": "distill.training.split",
    "distill.mid_layer": "distill.training.mid_layer",
    "distill.teacher_check": "distill.calibration.teacher_check",
    "distill.teacher_traffic": "distill.calibration.teacher_traffic",
    "distill.evaluate": "distill.calibration.evaluate",
    "distill.evidence": "distill.loop.evidence",
    "distill.retrain": "distill.loop.retrain",
    "distill.promote": "distill.loop.promote",
    "distill.collected": "distill.loop.collected",
    "distill.escalations": "distill.loop.escalations",
    "distill.auditing": "distill.loop.auditing",
    "distill.decide": "distill.loop.decide",
    "distill.report": "distill.reports.calibration_report",
    "distill.report_figures": "distill.reports.figures",
    "distill.demo_teacher": "distill.demo.teacher",
    "distill.synthetic": "distill.demo.synthetic",
    "distill.cli.serve_limits": "distill.cli.serve.limits",
    "distill.cli.serve_upstream": "distill.cli.serve.upstream",
}
"""Old module path -> new module path. Two old modules became packages of the same name, which
keep their old public names: ``distill.demo`` (see ``PACKAGE_NAMES``) and ``distill.cli.serve``
(its ``add_parser``, ``DESCRIPTION`` and ``EPILOG``, from ``distill.cli.serve.command``)."""

PACKAGE_NAMES = {
    "distill.demo": ("distill.demo.run", ("DemoConfig", "DemoError", "DemoInputs", "DemoResult",
                                          "format_summary", "run_demo")),
}
"""A package that replaced a module of its name: the module its old names now live in, and those
names (each still importable from the package, with a warning)."""


def alias(old: str) -> ModuleType:
    """Warn that ``old`` moved, and make it the new module (the caller is the old path's module)."""
    new = MOVED[old]
    warnings.warn(f"{old} moved to {new}; import {new} (the old path goes in the next release)",
                  DeprecationWarning, stacklevel=_importer_level())
    module = importlib.import_module(new)
    sys.modules[old] = module
    return module


def moved_name(package: str, name: str) -> object:
    """A package's old name (``distill.demo.run_demo``), from the module it now lives in, warning."""
    home, names = PACKAGE_NAMES[package]
    if name not in names:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    warnings.warn(f"{package}.{name} moved to {home}.{name}; import it from {home} (the old path "
                  "goes in the next release)", DeprecationWarning, stacklevel=3)
    return getattr(importlib.import_module(home), name)


def _importer_level() -> int:
    """The ``stacklevel`` of the code that imported the old path: past ``alias`` (1), the old
    path's module (2), and ``importlib.import_module`` where it was the importer. ``warnings``
    skips the import system's own frames (``importlib._bootstrap``) by itself, so they count for
    nothing here either."""
    frame = sys._getframe(2)  # the old path's module
    level = 2
    while frame.f_back is not None:
        frame = frame.f_back
        if _bootstrap(frame):
            continue
        level += 1
        if frame.f_code.co_filename != importlib.__file__:
            break
    return level


def _bootstrap(frame: FrameType) -> bool:
    name = frame.f_code.co_filename
    return "importlib" in name and "_bootstrap" in name
