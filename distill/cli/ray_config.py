"""``cascade ray-config``: the Ray Serve config of a bundle's cascade (``distill.rayserve.plan``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cascade.errors import CascadeError, OpenPortError
from cascade.teachers.admission import TEACHER_MAX_WAIT
from cascade.teachers.keys import UPSTREAM_KEY_VARIABLE
from distill.cli.common import teacher_argument
from distill.cli.values import number_between, output_file, positive_number, positive_seconds, whole_number

DESCRIPTION = """\
Write the Ray Serve config that runs a bundle's cascade on a Ray cluster: the same System One API
as `cascade serve` (the same SDKs, errors and Retry-After), with the cheap tiers in replicas
that Ray autoscales on their queue and the teacher in a deployment of its own. Start it with
`serve run OUT` (in the foreground, on a local or running cluster) or `serve deploy OUT` (to a
running cluster); a KubeRay RayService takes the same config as its serveConfigV2. Start Ray
with RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=distill.rayserve.proxy:middlewares in its
environment (every node): its proxies then send again a request whose replica died, which Ray
alone would answer 500.

Every cheap replica runs `cascade serve --bundle B --teacher ...` with the flags given after --
(for example --audit-store postgresql://... --audit-share 0.02: with one PostgreSQL store every
replica reads the others' audits, so a drift on one demotes the question on all). With --teacher
PATH.gguf the teacher runs `cascade serve --teacher PATH.gguf` in its own replicas (on
--teacher-gpus GPUs each where given, with every layer offloaded; else on --teacher-cpus CPUs),
at /teacher on the same proxy, and every cheap replica sends its escalations there; its queue
refuses with 503 and Retry-After past --teacher-max-wait as `cascade serve` does. With --teacher
URL there is no teacher deployment: the replicas call the URL. The bundle's path must be the same on every
node (a shared volume, or the image). To roll out a promoted bundle, give --bundle the pointer
or link that `cascade promote` replaces (each replica follows it), or write the config again with
the new bundle and `serve deploy` it: Ray replaces the replicas one by one, each taking traffic
only once its models have loaded. No secret goes after --: Ray copies the replicas' flags into
its logs and its dashboard's API, so the key is $CASCADE_API_KEY on every node (the teacher's
route checks it too), a store's password PGPASSWORD. Needs the ray-serve extra: pip install -e
'.[ray-serve]'."""
EPILOG = """\
examples:
  cascade ray-config --bundle models/support-v1 --teacher qwen3.5-4b-q4_k_m.gguf --teacher-gpus 1 \\
      --out serve.yaml -- --audit-store postgresql://cascade@db/labels --audit-share 0.02
  export RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=\\
distill.rayserve.proxy:middlewares
  serve run serve.yaml          # or: ray start --head; serve deploy serve.yaml
  curl -s localhost:8000/v1/systemone -d '{"state": "Charged twice!", "questions": {...}}'"""


def _cmd_ray_config(args: argparse.Namespace) -> int:
    from cascade.private import redact_url
    from cascade.serve.lifecycle import API_KEY_VARIABLE, check_auth
    from distill.cli.serve.command import options_of
    from distill.cli.serve.replicas import serve_args
    from distill.rayserve.plan import RayPlan, serve_config
    from distill.rayserve.proxy import START

    if args.serve_flags[:1] not in ([], ["--"]):  # argparse took the rest, ray-config's own flags too
        raise CascadeError(f"{args.serve_flags[0]} is not a flag of cascade ray-config: cascade serve's "
                           "flags for the replicas go last, after --")
    if args.out is None:
        raise CascadeError("give --out FILE: where to write the config")
    flags = args.serve_flags[1:]
    given = _given_flags(flags, args.teacher)
    plan = RayPlan(bundle=args.bundle, teacher=args.teacher, serve_flags=flags, host=args.host,
                   port=args.port, min_replicas=args.min_replicas, max_replicas=args.max_replicas,
                   target_ongoing_requests=args.target_ongoing, replica_cpus=args.replica_cpus,
                   teacher_replicas=args.teacher_replicas, teacher_gpus=args.teacher_gpus,
                   teacher_cpus=args.teacher_cpus, teacher_max_wait=args.teacher_max_wait,
                   open_on_purpose=given.insecure_no_auth,
                   sends_own_key=not (given.forward_auth or given.upstream_key_file is not None
                                      or given.upstream_key_env != UPSTREAM_KEY_VARIABLE))
    replica = serve_args(plan.cascade_argv())  # refused now, as the replicas would refuse them
    try:
        auth = check_auth(options_of(replica), replica.forward_auth, forwardable=True)
        if plan.local_teacher:  # its route is on the same proxy: refused open as the cheap one is
            check_auth(options_of(serve_args(plan.teacher_argv())), False, False)
    except OpenPortError:
        raise OpenPortError(f"--host {args.host} opens Ray's proxy to other machines and no key would be "
                           f"checked: set ${API_KEY_VARIABLE} here and on every Ray node (or give "
                           "--forward-auth after -- to have a URL teacher check each caller's key); or "
                           "--insecure-no-auth after -- to serve it open on purpose") from None
    _write(serve_config(plan), args.out)
    teacher = f"the teacher on {args.teacher_gpus:g} GPU(s) per replica" if args.teacher_gpus else \
        "the teacher on CPU" if plan.local_teacher else f"the teacher at {redact_url(args.teacher)}"
    print(f"wrote {args.out}: {args.min_replicas}-{args.max_replicas} cheap replicas, {teacher}; "
          f"start it with: {START} serve run {args.out}", file=sys.stderr)
    if auth.key is not None:
        print(f"the replicas check the key in ${API_KEY_VARIABLE}, which is not in the config: set it on "
              "every Ray node (a replica started without it on an open --host refuses to start)",
              file=sys.stderr)
    return 0


def _given_flags(flags: list[str], teacher: Path | str) -> argparse.Namespace:
    """The replicas' flags as ``cascade serve`` reads them, refused in one line where they set what
    is ray-config's (``--bundle=/etc`` and abbreviations slipped past a check of the raw words, and
    the replicas would have served it) or hold a secret: Ray copies the replicas' flags into its
    logs (mode 0644) and its dashboard's API, which any user of a node reads."""
    from cascade.private import redact_url
    from distill.cli.serve.replicas import serve_args

    given, defaults = serve_args(flags), serve_args([])
    ours = [f"--{name}" for name in ("bundle", "teacher", "host", "port")
            if getattr(given, name) != getattr(defaults, name)]
    if ours:
        raise CascadeError(f"{ours[0]} is ray-config's to set (the replicas' comes from it); give it to "
                           "ray-config itself, not after --")
    for flag, variable in (("api-key", "CASCADE_API_KEY"), ("metrics-key", "CASCADE_METRICS_KEY")):
        if getattr(given, flag.replace("-", "_")):
            raise CascadeError(f"--{flag} after -- would be copied by Ray into its logs and its "
                               f"dashboard's API, readable by any user of a node: set ${variable} on "
                               "every Ray node instead (the replicas read it there)")
    words = [*flags, str(teacher)]
    for value in words + [word.split("=", 1)[1] for word in words if word.startswith("--") and "=" in word]:
        if redact_url(value) != value:  # a URL's password or token, a ?password= (as libpq reads it)
            raise CascadeError(f"{redact_url(value)} holds a password, which Ray would copy into its logs "
                               "and its dashboard's API: give a store's in PGPASSWORD on every Ray node, "
                               "and an upstream's key by --upstream-key-env")
    return given


def _write(config: dict[str, object], out: Path) -> None:
    try:
        import yaml
    except ImportError as exc:
        raise CascadeError(f"writing a Ray Serve config needs PyYAML ({exc}): pip install -e "
                           "'.[ray-serve]'") from None
    from cascade.atomic import write_atomically

    # whole, and 0600: it names stores and paths (the secrets themselves are refused above)
    write_atomically(out, yaml.safe_dump(config, sort_keys=False))


def _gpus(text: str) -> float:
    """GPUs per teacher replica: 0 (on CPU), a share of one (replicas sharing a GPU), or more."""
    if text == "0":
        return 0.0
    try:
        return positive_number(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be 0 (on CPU) or a number of GPUs > 0; got {text!r}") \
            from None


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ray-config", help="write the Ray Serve config of a bundle's cascade (serve run)",
                       description=DESCRIPTION, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", type=Path, required=True, metavar="DIR",
                   help="the bundle (folder, link or pointer file) as the nodes see it: at the same path "
                   "on every node (a shared volume, or the image); not looked at here, where it may "
                   "not exist")
    p.add_argument("--teacher", type=teacher_argument, required=True, metavar="PATH.gguf|URL",
                   help="a GGUF, served by a teacher deployment of its own, or a System One URL to call")
    p.add_argument("--out", type=output_file, metavar="FILE",
                   help="where to write the config (YAML; required)")
    p.add_argument("--host", default="127.0.0.1",
                   help="where Ray's HTTP proxy listens (default 127.0.0.1; 0.0.0.0 for other machines: "
                   "set $CASCADE_API_KEY here and on every Ray node then)")
    p.add_argument("--port", type=whole_number(1, 65535), default=8000,
                   help="the proxy's port (default 8000)")
    p.add_argument("--min-replicas", type=whole_number(1), default=1, metavar="N",
                   help="fewest cheap-tier replicas (default 1)")
    p.add_argument("--max-replicas", type=whole_number(1), default=4, metavar="N",
                   help="most cheap-tier replicas (default 4)")
    p.add_argument("--target-ongoing", type=number_between(0.25, 10_000.0), default=16.0, metavar="N",
                   help="requests in flight per cheap replica that Ray's autoscaler aims at (default 16): "
                   "more per replica adds replicas, fewer removes them")
    p.add_argument("--replica-cpus", type=positive_number, default=1.0, metavar="N",
                   help="CPUs Ray reserves for each cheap replica (default 1)")
    p.add_argument("--teacher-replicas", type=whole_number(1), default=1, metavar="N",
                   help="replicas of a GGUF teacher (default 1)")
    p.add_argument("--teacher-gpus", type=_gpus, default=0.0, metavar="N",
                   help="GPUs per teacher replica (default 0: on CPU); with any, every layer is offloaded")
    p.add_argument("--teacher-cpus", type=positive_number, default=1.0, metavar="N",
                   help="CPUs per teacher replica, and its llama.cpp threads (default 1)")
    p.add_argument("--teacher-max-wait", type=positive_seconds, default=TEACHER_MAX_WAIT, metavar="S",
                   help="the teacher's queue admits a request only while its expected wait is at most "
                   "S (default %(default)g): past it 503 with Retry-After, which the cheap replica passes "
                   "on. An answer comes within S plus one read: keep that below the replicas' "
                   "--upstream-timeout (default 8), or the replica answers 504 instead")
    p.add_argument("serve_flags", nargs=argparse.REMAINDER, metavar="-- FLAGS",
                   help="flags of cascade serve for every cheap replica (see cascade serve --help)")
    p.set_defaults(run=_cmd_ray_config, hint="; cascade serve's flags for the replicas go last, after --")
