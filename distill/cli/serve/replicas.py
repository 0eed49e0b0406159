"""``cascade serve`` run by Ray Serve: the deployments of ``distill.rayserve.plan``'s config.

``CascadeReplica`` runs the app ``cascade serve --bundle B`` runs (``bundle_app``): the same
routes, validation, limits, errors and ``Retry-After``, so that SDKs pass unchanged. Each replica
opens ``--audit-store`` as the command does; with one PostgreSQL store every replica reads the
others' audits, so a drift seen on one demotes the question on all. ``TeacherReplica`` runs
``cascade serve --teacher X.gguf``'s app (``teacher_app``): one llama.cpp context per replica,
its queue admitted by expected wait (503 and ``Retry-After`` past it), which the cheap replicas
take as their URL teacher through Ray's proxy. A replica is healthy only once its models have
loaded (its own ``/health``), so a rolling update (a promoted bundle) routes no request to a
replica still loading. Ray (the ``ray-serve`` extra) is imported only once Ray builds the
application, through the builders the config's ``import_path`` names (``cascade_application``,
``teacher_application``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from typing import Any

import httpx

from cascade.errors import CascadeError
from cascade.serve.lifecycle import bundle_app, teacher_app
from distill.cli.common import placement_of
from distill.cli.serve.command import add_parser, bundle_parts, options_of

INSTALL = "pip install -e '.[ray-serve]'"
_HEALTH_POLL_S = 0.2


class ReplicaArgumentError(CascadeError, ValueError):
    """A replica's flags are not ones ``cascade serve`` takes; the message is argparse's."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # a replica has no terminal: raise, never exit
        raise ReplicaArgumentError(f"cascade serve flags of a Ray Serve replica: {message}")


def serve_args(argv: list[str]) -> argparse.Namespace:
    """``argv`` read as ``cascade serve`` reads its flags (``ReplicaArgumentError`` where it would
    refuse them)."""
    parser = _Parser(prog="cascade")
    add_parser(parser.add_subparsers())  # its parsers are _Parser too (argparse's default class)
    return parser.parse_args(["serve", *argv])


async def until_loaded(app: Any) -> bool:
    """Wait until ``app``'s own ``/health`` says ok (True: its models loaded) or failed (False)."""
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://replica") as client:
        while True:
            reply = await client.get("/health")
            if reply.status_code == 200:
                return True
            if reply.json().get("status") == "failed":
                return False
            await asyncio.sleep(_HEALTH_POLL_S)


class ProxyHeaders:
    """ASGI middleware for an app behind Ray's proxy, which adds ``X-Request-Id`` to every answer
    (the client's, or one it made and gave the app): the app's own copy is dropped, so that the
    header comes once, as from ``cascade serve``; and ``X-Cascade-Replica`` names the replica that
    answered (for logs, and for telling replicas apart from outside)."""

    def __init__(self, app: Any, replica: str) -> None:
        self.app, self.replica = app, replica.encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def sending(message: Any) -> None:
            if message["type"] == "http.response.start":
                kept = [(k, v) for k, v in message["headers"] if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*kept, (b"x-cascade-replica", self.replica)]}
            await send(message)

        await self.app(scope, receive, sending if scope["type"] == "http" else send)


class _Replica:
    """What both deployments share: the app built at replica start, healthy once loaded, and the
    resources held for its life closed when Ray stops it."""

    what = "the replica"

    def __init__(self) -> None:
        self._held = contextlib.ExitStack()
        self._app: Any = None
        self._failure: BaseException | None = None

    def _failed(self, exc: BaseException) -> None:
        self._failure = exc

    def _behind_proxy(self, app: Any) -> Any:
        from ray import serve

        app.add_middleware(ProxyHeaders, replica=serve.get_replica_context().replica_id.unique_id)
        self._app = app
        return app

    async def check_health(self) -> None:
        """Ray's health check (the first one gates the replica's traffic): raises once a load
        failed, and Ray replaces the replica."""
        if not await until_loaded(self._app):
            failure = self._failure
            raise CascadeError(f"{self.what} failed to load: {type(failure).__name__}: "
                               f"{failure}") from failure

    async def __del__(self) -> None:
        """Ray's shutdown: the app's own (requests in flight finish), then what the replica held."""
        shutdown = getattr(super(), "__del__", None)  # Ray's ingress wrapper: the app's lifespan
        if shutdown is not None:
            await shutdown()
        self._held.close()


class CascadeReplica(_Replica):
    """A replica of the cheap tiers: ``cascade serve --bundle B ...``'s app (``argv``: its flags)."""

    what = "the bundle"

    def __init__(self, argv: list[str]) -> None:
        super().__init__()
        self._args = serve_args(argv)
        if self._args.bundle is None:
            raise ReplicaArgumentError("a cascade replica serves a bundle: give --bundle DIR")
        self._parts = self._held.enter_context(bundle_parts(self._args))

    def __serve_build_asgi_app__(self) -> Any:
        app, _ = bundle_app(self._args.bundle, options_of(self._args), self._parts, on_failure=self._failed)
        return self._behind_proxy(app)


class TeacherReplica(_Replica):
    """A replica of the teacher: ``cascade serve --teacher X.gguf ...``'s app (``argv``: its flags)."""

    what = "the teacher model"

    def __init__(self, argv: list[str]) -> None:
        super().__init__()
        self._args = serve_args(argv)
        if self._args.bundle is not None or self._args.teacher is None or isinstance(self._args.teacher, str):
            raise ReplicaArgumentError("a teacher replica serves a GGUF alone: give --teacher PATH.gguf "
                                       "and no --bundle")

    def __serve_build_asgi_app__(self) -> Any:
        args = self._args
        app, _ = teacher_app(args.teacher, options_of(args), placement=placement_of(args), layout=args.layout,
                             on_failure=self._failed)
        return self._behind_proxy(app)


def cascade_application(args: dict[str, Any]) -> Any:
    """The application builder ``import_path`` names for the cheap tiers: ``args["argv"]``."""
    return _deployment(CascadeReplica, "cascade").bind(list(args["argv"]))


def teacher_application(args: dict[str, Any]) -> Any:
    """The application builder ``import_path`` names for a GGUF teacher: ``args["argv"]``."""
    return _deployment(TeacherReplica, "teacher").bind(list(args["argv"]))


def _deployment(replica: type, name: str) -> Any:
    try:
        from ray import serve
    except ImportError as exc:
        raise CascadeError(f"the Ray Serve application needs the ray-serve extra ({exc}): "
                           f"{INSTALL}") from None
    return serve.deployment(serve.ingress()(replica), name=name)
