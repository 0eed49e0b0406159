"""The checks a router makes before any model loads: the bundle's files, the top tier's
reach, the encoder's vectors, and the teacher given against the one its thresholds certify.

A server runs them (``Cascade.preflight``) before it opens its port, so a wrong teacher or a stale
bundle is one clear line at start-up, never a failure at the first request.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from cascade.bundle.manifest import VECTORS_ALONE_SCHEMA, Bundle, Manifest
from cascade.encoder.onnx_encoder import quantizes_per_call
from cascade.errors import CascadeError, RouterError
from cascade.hashing import file_sha256
from cascade.readout.placement import Placement, Placements
from cascade.readout.prompts import OPTIONS_FIRST_VERSION, PROMPT_VERSION, layout_of
from cascade.routing.endpoint import Teacher, gguf_of, same_endpoint, upstream_of
from cascade.teachers.settings import UpstreamSettings, url_or_path
from cascade.tiers.base import Build, Labels
from cascade.tiers.kinds import kind_of


def prepared(bundle_dir: Path, teacher: Teacher | None, labels: Labels | None,
             accept_other_teacher: bool, where: Build) -> tuple[Bundle, Build, bool]:
    """The bundle, how to build its tiers (``where``'s placement, with the teacher), and whether
    its answers are certified: every check before a model loads."""
    if teacher is not None and labels is not None:
        raise RouterError("give teacher (a GGUF to run) or labels (recorded answers), not both")
    teacher = _read_teacher(teacher)
    if not isinstance(bundle_dir, str | os.PathLike):
        raise RouterError(f"the bundle must be a folder's path; got {type(bundle_dir).__name__}")
    if where.cache_dir is not None and Path(where.cache_dir).exists() and not Path(where.cache_dir).is_dir():
        raise RouterError(f"cache_dir {where.cache_dir} is a file; give a folder for the embedding cache")
    bundle = Bundle.load(Path(bundle_dir))
    _check_placements(bundle.manifest, where.placements)
    upstream, expected = upstream_of(teacher), None
    if upstream is not None:
        certified, expected = same_endpoint(bundle.manifest, upstream.url, accept_other_teacher)
    gguf = gguf_of(teacher)
    build = replace(where, teacher=gguf, upstream=upstream, upstream_identity=expected, labels=labels)
    _check_top(bundle.manifest, build)
    _check_encoder_vectors(bundle)
    if upstream is None:
        certified = gguf is None or _same_teacher(bundle.manifest, gguf, accept_other_teacher)
    return bundle, build, certified


def _read_teacher(teacher: object) -> Teacher | None:
    """A teacher as ``Cascade.load`` takes it, checked: a GGUF path, an http(s) URL (its scheme
    lower-cased), ``UpstreamSettings`` or None; anything else refused in one line, redacted."""
    if teacher is None or isinstance(teacher, Path | UpstreamSettings):
        return teacher
    if not isinstance(teacher, str):
        raise RouterError(f"teacher must be a GGUF's path, an http(s):// URL or UpstreamSettings; got "
                          f"{type(teacher).__name__}")
    try:
        return url_or_path(teacher)
    except CascadeError as exc:
        raise RouterError(str(exc)) from None


def _check_placements(manifest: Manifest, placements: Placements) -> None:
    """Placements must be ``Placement`` objects, per tier under the bundle's tier names: a dict's
    fields, or a mistyped tier's name, were read as nothing, and the tier ran where it would have."""
    given = placements.values() if isinstance(placements, Mapping) else [placements]
    wrong = [p for p in given if p is not None and not isinstance(p, Placement)]
    if wrong:
        raise RouterError("placement must be one Placement, or a mapping of tier names to Placement; got "
                          f"{type(wrong[0]).__name__}")
    names = [tier.name for tier in manifest.tiers]
    unknown = [name for name in placements if name not in names] if isinstance(placements, Mapping) else []
    if unknown:
        raise RouterError(f"placement names {', '.join(map(repr, unknown))}, not a tier of bundle "
                          f"{manifest.name!r}: its tiers are {', '.join(names)}")


def _check_top(manifest: Manifest, build: Build) -> None:
    """Before loading any model: can the top tier answer what reaches it?"""
    top = manifest.tiers[-1]
    if build.teacher is not None and not build.teacher.is_file():
        what = "is a folder" if build.teacher.is_dir() else "not found"
        raise RouterError(f"teacher model {build.teacher} {what}; give the path of a .gguf file")
    kind_of(top).check_top(top, manifest.name, build)


def _check_encoder_vectors(bundle: Bundle) -> None:
    """Refuse thresholds certified on vectors the encoder no longer computes.

    Before schema 3, an encoder that quantizes activations per call (a fine-tuned int8 export)
    ran in batches, so each vector calibration saw depended on its batch; it now runs each text
    alone (``cascade.encoder.onnx_encoder``), and those thresholds say nothing about these numbers.
    """
    tier = bundle.manifest.encoder_tier
    if (tier is None or bundle.manifest.schema_version >= VECTORS_ALONE_SCHEMA
            or not quantizes_per_call(tier.model_path(bundle.directory))):
        return
    raise RouterError(f"bundle {bundle.manifest.name!r} (schema {bundle.manifest.schema_version}) was "
                      f"calibrated on vectors of {tier.model_path(bundle.directory).name} that depended "
                      "on their batch (dynamic int8 scales activations over the whole batch); this "
                      "cascade computes each text's vector alone: run `cascade calibrate` on the bundle "
                      "again to certify its thresholds on those")


def _same_teacher(manifest: Manifest, teacher: Path, accept: bool) -> bool:
    """Whether ``teacher`` is the model the bundle's labels came from; refused if not, unless
    ``accept``: then answers are marked uncertified instead."""
    pinned = manifest.teacher
    problem = ""
    if pinned.kind != "gguf" or pinned.model_sha256 is None:
        problem = f"its labels are {pinned.kind} labels ({pinned.model!r}), not a GGUF's"
    elif file_sha256(teacher) != pinned.model_sha256:
        problem = (f"its labels came from {pinned.model!r} (sha256 {pinned.model_sha256[:12]}...), "
                   f"and {teacher.name} has sha256 {file_sha256(teacher)[:12]}...")
    elif layout_of(pinned.prompt_version) is None:
        problem = (f"its labels were read with prompt {pinned.prompt_version!r}, which this version "
                   f"cannot read with (it reads {PROMPT_VERSION!r} and {OPTIONS_FIRST_VERSION!r})")
    if problem and not accept:
        raise RouterError(f"bundle {manifest.name!r} cannot escalate to {teacher}: {problem}; give "
                          f"that teacher, or accept another (--accept-other-teacher / "
                          f"accept_other_teacher=True) and get answers marked certified=false")
    return not problem
