"""A URL as a bundle's teacher: what its answers must state to be the teacher the bundle was
certified against.

A bundle certified against a GGUF is answered by that GGUF's own server (``cascade serve
--teacher X.gguf``) when every answer's audit states the GGUF's sha256 as ``model_hash`` and each
question's prompt hash as that prompt version makes it; a bundle certified against an endpoint,
when the answers state the identity its labels recorded. Labels known only by name (external)
give nothing to check. The tier checks every answer (``cascade.teachers.identity``).
"""

from __future__ import annotations

from pathlib import Path

from cascade.bundle.manifest import Manifest
from cascade.errors import RouterError
from cascade.private import redact_url
from cascade.readout.prompts import layout_of, template_sha256
from cascade.teachers.identity import EndpointIdentity
from cascade.teachers.settings import UpstreamSettings, is_url

Teacher = Path | str | UpstreamSettings
"""What ``Cascade.load(teacher=...)`` takes: a GGUF path, or an upstream URL (or its settings)."""


def upstream_of(teacher: Teacher | None) -> UpstreamSettings | None:
    """The upstream settings of a teacher given as a URL (default limits), None for a GGUF path."""
    if isinstance(teacher, UpstreamSettings):
        return teacher
    return UpstreamSettings(str(teacher)) if is_url(teacher) else None


def gguf_of(teacher: Teacher | None) -> Path | None:
    """The GGUF path of a teacher given as one, None for a URL (or no teacher)."""
    if teacher is None or isinstance(teacher, UpstreamSettings) or is_url(teacher):
        return None
    return Path(teacher)


def expected_identity(manifest: Manifest) -> EndpointIdentity | None:
    """What a URL teacher's answers must state to be the bundle's teacher; None where its labels
    leave nothing to check (external labels, a prompt version this cascade cannot read)."""
    teacher = manifest.teacher
    if teacher.kind == "endpoint":
        return teacher.endpoint_identity()
    if teacher.kind != "gguf" or not teacher.prompt_version or layout_of(teacher.prompt_version) is None:
        return None
    return EndpointIdentity(model_hash=teacher.model_sha256, templates={
        qid: template_sha256(q, teacher.prompt_version) for qid, q in manifest.parsed_questions().items()})


def same_endpoint(manifest: Manifest, url: str, accept: bool) -> tuple[bool, EndpointIdentity | None]:
    """(certified, the identity to expect) for an upstream teacher at ``url``. Refused where the
    bundle's labels give nothing to check it against, unless ``accept``: then nothing is
    expected and every answer is marked uncertified, as with another GGUF accepted."""
    expected = expected_identity(manifest)
    if accept:
        return False, None
    if expected is None:
        raise RouterError(
            f"bundle {manifest.name!r} cannot escalate to {redact_url(url)}: its thresholds were certified "
            f"against {manifest.teacher.kind} labels ({manifest.teacher.model!r}), which state no identity "
            "an upstream's answers could be checked against; give that teacher, or accept another "
            "(--accept-other-teacher / accept_other_teacher=True) and get answers marked certified=false")
    return True, expected
