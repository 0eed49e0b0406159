"""``cascade serve``'s flags for a URL teacher (the upstream's client, forwarded auth, its price)
and for the traffic a pass-through collects, and what they build."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from distill.cli.common import STORE_METAVAR, store_argument
from distill.cli.endpoint import add_endpoint_arguments, key_source
from distill.cli.values import positive_seconds, share, whole_number

if TYPE_CHECKING:
    from cascade.cost.upstream import UpstreamPrice
    from cascade.teachers.settings import UpstreamSettings


def add_upstream_arguments(p: argparse.ArgumentParser) -> None:
    url = p.add_argument_group("a URL teacher (--teacher http://host:port/v1/systemone)")
    add_endpoint_arguments(url)
    url.add_argument("--upstream-timeout", type=positive_seconds, default=8.0, metavar="S",
                     help="seconds to wait for one upstream answer (default 8; every call, retries "
                     "included, ends within 9 s, below the SDKs' 10 s)")
    url.add_argument("--upstream-in-flight", type=whole_number(1), default=32, metavar="N",
                     help="most calls to the upstream at once (default 32)")
    url.add_argument("--forward-auth", action="store_true",
                     help="send each caller's Authorization to the upstream instead of a key of this "
                     "server's, and have it check the caller on every route but /health (refused with "
                     "--api-key: a caller sends one key); answers computed here go only to keys the "
                     "upstream accepted in the last 60 s (a key's next request after that goes upstream "
                     "whole, so a key revoked there loses local answers within 60 s); a 401/403 from it "
                     "revokes the key at once and refuses it here for 10 s without asking again")
    url.add_argument("--upstream-compress", choices=("auto", "zstd", "gzip", "identity"), default="auto",
                     help="how bodies of 1 KiB and more go upstream (default auto: zstd, falling back to "
                     "gzip, then none, at the first the upstream refuses, and kept; identity: none)")
    add_upstream_price_argument(url, "/metrics then says what was spent and saved in that unit (default: "
                                "priced by its measured latency, in seconds)")
    collect = p.add_argument_group("collecting traffic (a pass-through: --teacher URL without --bundle)")
    collect.add_argument("--collect", type=store_argument, metavar=STORE_METAVAR,
                         help="label store to record forwarded requests in: state, questions, the upstream's "
                         "answers and identity (`cascade collected` turns them into a training set)")
    collect.add_argument("--collect-share", type=share, default=1.0, metavar="F",
                         help="seeded share of forwarded requests recorded, in [0, 1] (default 1)")
    collect.add_argument("--collect-max", type=whole_number(0), default=None, metavar="N",
                         help="stop recording once the store holds N requests (default: no limit)")


def upstream_settings(args: argparse.Namespace) -> UpstreamSettings:
    """The upstream client's settings from the parsed flags (``--teacher`` is the URL)."""
    from cascade.teachers.settings import UpstreamSettings

    timeout = args.upstream_timeout
    return UpstreamSettings(args.teacher, model=args.upstream_model, forward_auth=args.forward_auth,
                            key=key_source(args), compress=args.upstream_compress,
                            read_timeout=timeout, deadline=max(9.0, timeout + 1.0),
                            max_in_flight=args.upstream_in_flight)


def add_upstream_price_argument(
        p: argparse.ArgumentParser | argparse._ArgumentGroup,
        then: str = "the calls and questions a teacher behind a URL would get are also priced in that unit",
) -> None:
    p.add_argument("--upstream-price", type=price_argument, metavar="SPEC",
                   help=f"what the upstream costs: request=X,question=Y,unit=NAME (e.g. "
                   f"request=0.002,question=0.0005,unit=USD); {then}")


def price_argument(text: str) -> UpstreamPrice:
    """An ``--upstream-price`` SPEC, refused before any work starts."""
    from cascade.cost.upstream import UpstreamPrice
    from cascade.errors import CascadeError

    try:
        return UpstreamPrice.parse(text)
    except CascadeError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--upstream-price: ")) from None
