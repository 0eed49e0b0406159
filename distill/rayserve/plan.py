"""The Ray Serve config of a cascade: what ``cascade ray-config`` writes, for ``serve run`` or
``serve deploy``.

Two applications on one Ray HTTP proxy: ``cascade`` at ``/`` (the System One API, the cheap
tiers' replicas, autoscaled on their queue: ``target_ongoing_requests`` per replica) and, for a
GGUF teacher, ``teacher`` at ``/teacher`` (its own replicas, each on ``teacher_gpus`` GPUs where
given, else on ``teacher_cpus`` CPUs). The cheap replicas reach the teacher through the proxy of
their own node (``proxy_location: EveryNode``), at ``http://127.0.0.1:PORT/teacher/v1/systemone``;
with a URL teacher there is no teacher application and the replicas call the URL. Each replica
runs ``cascade serve`` with ``serve_flags``, so every flag of that command (``--audit-store``,
``--max-wait``, ``--api-key`` ...) means here what it means there. Ray lets a replica hold four
times its autoscaling target in flight, and a teacher replica 256, so that overload meets the
apps' own admission (503 with ``Retry-After``, by expected wait) rather than a queue in Ray.

The teacher application checks the key the cheap one checks, ``$CASCADE_API_KEY`` on the nodes
(a key on the command line is refused: Ray copies the replicas' flags into its logs and its
dashboard's API), and the cheap replicas send it there (``--upstream-key-env``). Before, the
teacher's route took any caller, and with the variable set, as on KubeRay, refused the cheap
replicas' escalations. Both get ``--host`` where it is not loopback, so that a replica started
where no key is set refuses to start, as ``cascade serve`` does, rather than serve open.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cascade.errors import CascadeError
from cascade.serve.lifecycle import API_KEY_VARIABLE
from cascade.teachers.admission import TEACHER_MAX_WAIT
from cascade.teachers.keys import is_loopback

TEACHER_PREFIX = "/teacher"


@dataclass(frozen=True)
class RayPlan:
    """What runs where. ``bundle``: the bundle folder (or the link or pointer file that
    ``cascade promote`` replaces) as every node sees it; ``teacher``: a GGUF path, or a System
    One URL; ``serve_flags``: more flags of ``cascade serve`` for every cheap replica (none that sets
    what the plan sets, nor a secret: ``cascade ray-config`` checks them as a replica parses them)."""

    bundle: Path
    teacher: Path | str
    serve_flags: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 8000
    min_replicas: int = 1
    max_replicas: int = 4
    target_ongoing_requests: float = 16.0
    replica_cpus: float = 1.0
    teacher_replicas: int = 1
    teacher_gpus: float = 0.0
    teacher_cpus: float = 1.0
    teacher_max_wait: float = TEACHER_MAX_WAIT
    open_on_purpose: bool = False
    """``--insecure-no-auth`` among ``serve_flags``: the teacher is served open as well."""
    sends_own_key: bool = True
    """Whether the cheap replicas send a key of ray-config's choosing to the teacher: not with
    ``--forward-auth`` (the caller's goes), nor where ``--upstream-key-env`` or ``-file`` is given."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise CascadeError(f"replicas: need 1 <= --min-replicas <= --max-replicas; got "
                               f"{self.min_replicas} and {self.max_replicas}")

    @property
    def local_teacher(self) -> bool:
        return not isinstance(self.teacher, str)

    def teacher_url(self) -> str:
        """Where the cheap replicas send escalations."""
        if isinstance(self.teacher, str):
            return self.teacher
        return f"http://127.0.0.1:{self.port}{TEACHER_PREFIX}/v1/systemone"

    def cascade_argv(self) -> list[str]:
        own = ["--upstream-key-env", API_KEY_VARIABLE] if self.local_teacher and self.sends_own_key else []
        return ["--bundle", str(self.bundle), "--teacher", self.teacher_url(), *self._host(), *own,
                *self.serve_flags]

    def teacher_argv(self) -> list[str]:
        placed = ["--gpu-layers", "999"] if self.teacher_gpus > 0 else []
        threads = ["--threads", str(max(1, int(self.teacher_cpus)))]
        auth = ["--insecure-no-auth"] if self.open_on_purpose else []
        return ["--teacher", str(self.teacher), *placed, *threads, "--max-wait", f"{self.teacher_max_wait:g}",
                *self._host(), *auth]

    def _host(self) -> list[str]:
        return [] if is_loopback(self.host) else ["--host", self.host]


def serve_config(plan: RayPlan) -> dict[str, Any]:
    """The config, as ``serve run``, ``serve deploy`` and a RayService's ``serveConfigV2`` read it."""
    apps = [_cascade_app(plan)]
    if plan.local_teacher:
        apps.insert(0, _teacher_app(plan))
    return {"proxy_location": "EveryNode", "http_options": {"host": plan.host, "port": plan.port},
            "applications": apps}


def _cascade_app(plan: RayPlan) -> dict[str, Any]:
    return {"name": "cascade", "route_prefix": "/",
            "import_path": "distill.cli.serve.replicas:cascade_application",
            "args": {"argv": plan.cascade_argv()},
            "deployments": [{"name": "cascade", "max_ongoing_requests": int(4 * plan.target_ongoing_requests),
                             "autoscaling_config": {"min_replicas": plan.min_replicas,
                                                    "max_replicas": plan.max_replicas,
                                                    "target_ongoing_requests": plan.target_ongoing_requests},
                             "ray_actor_options": {"num_cpus": plan.replica_cpus}}]}


def _teacher_app(plan: RayPlan) -> dict[str, Any]:
    actor: dict[str, Any] = {"num_cpus": plan.teacher_cpus}
    if plan.teacher_gpus > 0:
        actor["num_gpus"] = plan.teacher_gpus
    return {"name": "teacher", "route_prefix": TEACHER_PREFIX,
            "import_path": "distill.cli.serve.replicas:teacher_application",
            "args": {"argv": plan.teacher_argv()},
            "deployments": [{"name": "teacher", "num_replicas": plan.teacher_replicas,
                             "max_ongoing_requests": 256, "ray_actor_options": actor}]}
