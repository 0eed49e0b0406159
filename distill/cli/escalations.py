"""The flags that keep a cascade's escalations (``serve`` and ``decide``): how many, where, and
the combinations refused before any model loads."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from cascade.errors import CascadeError
from distill.cli.values import share

if TYPE_CHECKING:
    from distill.loop.escalations import StoreEscalations


def add_escalation_arguments(p: argparse.ArgumentParser, chosen: str) -> argparse._ArgumentGroup:
    """--escalation-share and --escalation-seed, in a group the caller may add to; ``chosen``
    names what the share is drawn from."""
    kept = p.add_argument_group("keeping escalations (with --audit-store)")
    kept.add_argument("--escalation-share", type=share, default=0.0, metavar="F",
                      help=f"seeded share of {chosen} whose teacher answers to escalated questions are kept "
                      "in --audit-store, in [0, 1] (default 0: none): the items the fast tier found hard, "
                      "which `cascade retrain` trains on (they never certify: the cascade chose them; "
                      "except where it sent a question up whatever the item, holding no threshold for "
                      "it: those are a census of that traffic, and certify)")
    kept.add_argument("--escalation-seed", default="escalations", metavar="TEXT",
                      help="seed of the escalation share (default 'escalations')")
    return kept


def check_escalations(args: argparse.Namespace, bundle: bool = True) -> None:
    """Refuse what cannot keep escalations: no bundle or store, or a teacher the bundle does not
    name (a store never mixes two teachers)."""
    if args.escalation_share > 0 and (not bundle or args.audit_store is None):
        missing = "--audit-store" if bundle else "--bundle and --audit-store"
        raise CascadeError("--escalation-share keeps a cascade's escalations in the bundle's label store: "
                           f"give {missing}")
    if args.escalation_share > 0 and args.accept_other_teacher:
        raise CascadeError("--escalation-share keeps the answers of the teacher the bundle names, and "
                           "--accept-other-teacher runs another: give --escalation-share 0")


def escalation_store(args: argparse.Namespace, bundle: Path) -> StoreEscalations | None:
    """Where escalations are kept: --audit-store, bound to the bundle's teacher (None: not kept)."""
    if args.escalation_share == 0:
        return None
    from cascade.bundle.manifest import Bundle
    from distill.loop.auditing import bundle_teacher
    from distill.loop.escalations import StoreEscalations

    return StoreEscalations(args.audit_store, bundle_teacher(Bundle.load(bundle, verify=False).manifest))
