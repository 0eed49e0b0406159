"""Opening an upstream's client, with httpx imported only then (it is in the upstream extra)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cascade.errors import CascadeError
from cascade.teachers.settings import UPSTREAM_EXTRA, UpstreamSettings

if TYPE_CHECKING:
    from cascade.teachers.client import UpstreamClient


def open_client(settings: UpstreamSettings) -> UpstreamClient:
    """The pooled client of one upstream; a ``CascadeError`` naming the extra where httpx is missing."""
    try:
        from cascade.teachers.client import UpstreamClient
    except ImportError as exc:
        raise CascadeError(f"an upstream teacher needs the upstream extra ({exc}): "
                           f"{UPSTREAM_EXTRA}") from None
    return UpstreamClient(settings)
