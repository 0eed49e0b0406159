"""What the offline entry points share: the corpus a run reads, and how and where it runs.

``train_bundle``, ``calibrate_bundle`` and ``evaluate_bundle`` take a ``CorpusInput`` and a
``RunOptions`` instead of repeating their fields. Both are checked once, when made (the
scikit-learn way): a bad value raises ``OptionError`` naming the parameter, the value and what
is allowed, and the code behind the entry points trusts them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from cascade.checks import is_finite
from cascade.corpus import ON_ERROR, BadLine, CorpusItem, OnError, read_corpus
from cascade.encoder.onnx_encoder import DEVICES, Device
from cascade.errors import CascadeError
from cascade.readout.placement import Placement, Placements

DEFAULT_TEXT_FIELD = "text"


class OptionError(CascadeError, ValueError):
    """An option object, or an entry point's option argument, given a value it does not allow."""


def refuse(owner: str, name: str, value: Any, allowed: str) -> NoReturn:
    """Raise the one error shape every parameter check here uses."""
    raise OptionError(f"The {name!r} parameter of {owner} must be {allowed}. Got {value!r} instead.")


def default_cache_dir() -> Path:
    """Where embeddings are kept between runs: $XDG_CACHE_HOME/cascade, else ~/.cache/cascade."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cascade"


@dataclass(frozen=True)
class CorpusInput:
    """A JSONL corpus to read, and what to do at a line that cannot be read.

    ``text_field`` names the field holding each state; None: the field the bundle was trained on
    where there is a bundle, else "text". A bad line stops the run (``on_error="stop"``), or with
    ``"skip"`` goes to ``on_bad`` and its item is left out, as ``cascade.corpus.read_corpus`` does.
    """

    path: Path
    text_field: str | None = None
    on_error: OnError = "stop"
    on_bad: Callable[[BadLine], None] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.path, str | os.PathLike) or not str(self.path):
            refuse("CorpusInput", "path", self.path, "the path (str or pathlib.Path) of a JSONL corpus")
        object.__setattr__(self, "path", Path(self.path))
        if self.text_field is not None and not (isinstance(self.text_field, str) and self.text_field):
            refuse("CorpusInput", "text_field", self.text_field,
                   "a non-empty str naming each line's state field, or None (the bundle's)")
        if self.on_error not in ON_ERROR:
            refuse("CorpusInput", "on_error", self.on_error, " or ".join(map(repr, ON_ERROR)))
        if self.on_bad is not None and not callable(self.on_bad):
            refuse("CorpusInput", "on_bad", self.on_bad, "a callable that receives each skipped BadLine")
        if self.on_error == "skip" and self.on_bad is None:
            refuse("CorpusInput", "on_bad", self.on_bad, "a callable that receives each skipped BadLine "
                   "(for example a list's append) when on_error='skip', so that no line vanishes unseen")

    def field(self, trained: str | None = None) -> str:
        """The field to read: the one given, else the bundle's ``trained`` field, else "text"."""
        return self.text_field or trained or DEFAULT_TEXT_FIELD

    def read(self, trained: str | None = None) -> Iterator[CorpusItem]:
        """The corpus items, as ``read_corpus`` yields them (``trained``: see ``field``)."""
        return read_corpus(self.path, self.field(trained), self.on_error, self.on_bad)


@dataclass(frozen=True)
class RunOptions:
    """How and where a run goes.

    ``progress``: show progress bars. ``placement``: where the GGUF tiers it opens run (one
    ``Placement`` for all, one per tier name, or None: each tier's default;
    ``cascade.readout.placement``). ``device``: where the encoder runs. ``cache_dir``: an
    embedding cache folder (training's default: ``default_cache_dir()``; elsewhere None: none).
    ``flops_per_second``: this machine's throughput, to price tiers without a measured cost on
    the roofline (None: measured, or the router's default). ``threads``: CPU threads of every
    model the run opens where ``placement`` does not say (None: all cores). An entry point
    refuses a field it has no use for rather than ignore it.
    """

    progress: bool = True
    placement: Placements = None
    device: Device = "cpu"
    cache_dir: Path | None = None
    flops_per_second: float | None = None
    threads: int | None = None

    def __post_init__(self) -> None:
        if self.threads is not None and (not isinstance(self.threads, int) or isinstance(self.threads, bool)
                                         or self.threads < 1):
            refuse("RunOptions", "threads", self.threads, "a whole number >= 1, or None (all cores)")
        if not isinstance(self.progress, bool):
            refuse("RunOptions", "progress", self.progress, "True or False")
        if not _is_placements(self.placement):
            refuse("RunOptions", "placement", self.placement,
                   "a Placement, a mapping of tier names to Placements, or None")
        if self.device not in DEVICES:
            refuse("RunOptions", "device", self.device, " or ".join(map(repr, DEVICES)))
        if self.cache_dir is not None:
            if not isinstance(self.cache_dir, str | os.PathLike) or not str(self.cache_dir):
                refuse("RunOptions", "cache_dir", self.cache_dir,
                       "a folder path (str or pathlib.Path), or None")
            object.__setattr__(self, "cache_dir", Path(self.cache_dir))
        flops = self.flops_per_second
        if flops is not None and not (is_finite(flops) and flops > 0):
            refuse("RunOptions", "flops_per_second", flops, "a finite number > 0, or None")

    def unused(self, owner: str, *names: str) -> None:
        """Refuse the fields ``names`` that ``owner`` has no use for where they are set."""
        defaults = {f.name: f.default for f in fields(self)}
        for name in names:
            if getattr(self, name) != defaults[name]:
                refuse(owner, f"run.{name}", getattr(self, name),
                       f"left at {defaults[name]!r} ({owner} has no use for it)")


def _is_placements(value: object) -> bool:
    if value is None or isinstance(value, Placement):
        return True
    return isinstance(value, Mapping) and all(isinstance(k, str) and isinstance(v, Placement)
                                              for k, v in value.items())


T = TypeVar("T")


def option(owner: str, name: str, value: T | None, kind: type[T], default: T | None = None) -> T:
    """``value`` where it is a ``kind``; ``default`` where it is None and there is one; else an
    OptionError that says how to make one."""
    if value is None and default is not None:
        return default
    if not isinstance(value, kind):
        refuse(owner, name, value, f"a {kind.__name__} (from distill.options import {kind.__name__})")
    return value
