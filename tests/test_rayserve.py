"""The cascade as a Ray Serve application on a local Ray cluster (4 logical CPUs, head on loopback,
started here): the config ``cascade ray-config`` writes, started by ``serve run`` as a user would,
two cheap-tier replicas and a teacher deployment (gemma-3-270m on CPU), called over HTTP by the
published SDKs' own code. Routes are fixed by the bundle (``servers``): "urgent" stays at the
encoder, "department" goes to the teacher deployment."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import httpx
import pytest
from corpora import QUESTIONS_JSON, corpus_items
from servers import ESCALATED, KEPT, free_port, serving_bundle
from test_audit import items

from cascade.bundle.manifest import Bundle, Manifest
from distill.cli import main
from distill.rayserve.proxy import IMPORT_PATH, RECEIVE_TIMEOUT, VARIABLE

ray = pytest.importorskip(
    "ray.serve", reason="Ray Serve is an optional extra: pip install -e '.[ray-serve]' (.ci/run installs "
    "it and runs this file)")
yaml = pytest.importorskip("yaml", reason="the ray-serve extra brings PyYAML")

pytest_plugins = ("pgfixtures",)  # postgres_url: a fresh database on a real server
STATE = corpus_items()[5].text  # like the training messages, so that the encoder's gate lets it in
READY_S = 600.0  # loading two encoders and gemma on two shared cores
SCORE = {"type": "score", "instructions": "How severe is the problem?",
         "criteria": ["Minor", "Degraded", "Blocking"]}


@pytest.fixture(scope="module")
def bundle_dir(trained_bundle: Bundle, gemma_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return serving_bundle(trained_bundle, tmp_path_factory.mktemp("rayserve") / "support", gemma_path)


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest) -> Iterator[str]:
    """A local Ray cluster owned by this process; its address lets ``serve run`` in. Its proxy
    sends again a request whose replica died (``distill.rayserve.proxy``), as docs/ray-serve.md
    says to start a cluster, and its workers have the store's password in PGPASSWORD, as the docs
    say to give it (ray-config refuses one in a URL: Ray copies the flags into its logs)."""
    import ray

    try:
        password = urlsplit(request.getfixturevalue("postgres_server")).password
    except pytest.skip.Exception:  # no PostgreSQL here: the tests that need one skip on their own
        password = None
    if password:
        os.environ["PGPASSWORD"] = password
    os.environ[VARIABLE] = IMPORT_PATH  # the raylet's environment, so its workers'
    ray.init(num_cpus=4, include_dashboard=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        from ray import serve

        serve.shutdown()
        ray.shutdown()
        del os.environ[VARIABLE]
        os.environ.pop("PGPASSWORD", None)


def passwordless(url: str) -> str:
    """A store's URL as a replica's flags give it: its password is the workers' PGPASSWORD."""
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{parts.username}@{host}" if parts.username else host))


TEACHER_MAX_WAIT = "2"
"""Seconds of expected wait the teacher's queue admits: a burst of forty is past it at once."""
UPSTREAM_TIMEOUT = "120"
"""Seconds a replica waits for the teacher's answer: past TEACHER_MAX_WAIT plus one read however
slow the shared cores are, so that a burst gets answers and 503s, never a 504."""


def write_config(out: Path, bundle: Path, teacher: Path, port: int, *serve_flags: str) -> dict:
    argv = ["ray-config", "--bundle", str(bundle), "--teacher", str(teacher), "--out", str(out),
            "--port", str(port), "--min-replicas", "2", "--max-replicas", "2", "--replica-cpus", "1",
            "--teacher-cpus", "1", "--teacher-max-wait", TEACHER_MAX_WAIT, "--", "--threads", "1",
            *serve_flags]
    assert main(argv) == 0
    return yaml.safe_load(out.read_text())


def serve_run(config: Path, address: str) -> None:
    """``serve run CONFIG`` as a user starts it, on this cluster; returns once submitted."""
    command = [str(Path(sys.executable).with_name("serve")), "run", "--address", address, "--non-blocking",
               str(config)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env={**os.environ})
    assert done.returncode == 0, done.stderr


def post(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/systemone", json=body, timeout=300)


def answered(url: str, body: dict) -> dict:
    """The answer to ``body``, asked again after each 503's Retry-After as a client does (the
    teacher refuses what its queue cannot take in time)."""
    for _ in range(30):
        reply = post(url, body)
        if reply.status_code != 503:
            assert reply.status_code == 200, reply.text
            return reply.json()
        time.sleep(int(reply.headers["retry-after"]))
    raise AssertionError(f"still refused after 30 tries: {reply.text}")


def wait_ready(url: str) -> None:
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=10).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not ready after {READY_S:.0f} s")


@dataclass
class Deployed:
    """The application as ``serve run`` started it on ``cluster``; ``deploy`` updates its config
    as a user would (``serve run`` again: Ray's own rolling update)."""

    cluster: str
    port: int
    directory: Path
    teacher: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def deploy(self, bundle: Path, *serve_flags: str) -> None:
        config = self.directory / f"serve-{uuid.uuid4().hex[:6]}.yaml"
        write_config(config, bundle, self.teacher, self.port, "--max-wait", "600", "--upstream-timeout",
                     UPSTREAM_TIMEOUT, *serve_flags)
        serve_run(config, self.cluster)

    def rolled(self, old: list[str]) -> None:
        """Wait until no replica of ``old`` is left and the new ones answer."""
        deadline = time.monotonic() + READY_S
        while set(replicas("cascade")) & set(old) or len(replicas("cascade")) < 2:
            assert time.monotonic() < deadline, f"the update did not replace {old}: {replicas('cascade')}"
            time.sleep(0.5)
        wait_ready(f"{self.url}/health")


@pytest.fixture(scope="module")
def deployed(cluster: str, bundle_dir: Path, gemma_path: Path, tmp_path_factory: pytest.TempPathFactory
             ) -> Deployed:
    app = Deployed(cluster, free_port(), tmp_path_factory.mktemp("config"), gemma_path)
    app.deploy(bundle_dir)
    wait_ready(f"{app.url}/teacher/health")
    wait_ready(f"{app.url}/health")
    return app


@pytest.fixture
def app_url(deployed: Deployed) -> str:
    return deployed.url


def test_the_config_places_two_deployments_and_autoscales_the_cheap_one(
        bundle_dir: Path, gemma_path: Path, tmp_path: Path) -> None:
    config = write_config(tmp_path / "serve.yaml", bundle_dir, gemma_path, 8123, "--audit-share", "0")
    teacher, cascade = config["applications"]
    assert (teacher["route_prefix"], cascade["route_prefix"]) == ("/teacher", "/")
    assert teacher["deployments"][0]["ray_actor_options"] == {"num_cpus": 1.0}, "no GPU given: on CPU"
    scaling = cascade["deployments"][0]["autoscaling_config"]
    assert (scaling["min_replicas"], scaling["max_replicas"]) == (2, 2)
    assert cascade["args"]["argv"][:4] == ["--bundle", str(bundle_dir), "--teacher",
                                           "http://127.0.0.1:8123/teacher/v1/systemone"]
    gpu = tmp_path / "gpu.yaml"
    main(["ray-config", "--bundle", str(bundle_dir), "--teacher", str(gemma_path), "--out", str(gpu),
          "--teacher-gpus", "1"])
    placed = yaml.safe_load(gpu.read_text())["applications"][0]
    assert placed["deployments"][0]["ray_actor_options"]["num_gpus"] == 1.0
    assert placed["args"]["argv"][2:4] == ["--gpu-layers", "999"]


def test_flags_a_replica_would_refuse_are_refused_when_the_config_is_written(
        bundle_dir: Path, gemma_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "serve.yaml"
    base = ["ray-config", "--bundle", str(bundle_dir), "--teacher", str(gemma_path), "--out", str(out)]
    assert main([*base, "--", "--max-wait", "soon"]) == 2
    assert "argument --max-wait: must be a number of seconds > 0; got 'soon'" in capsys.readouterr().err
    assert main([*base, "--host", "0.0.0.0"]) == 2
    assert "CASCADE_API_KEY" in capsys.readouterr().err, "an open port with no key: refused as cascade serve"
    assert main([*base, "--", "--bundle", str(bundle_dir)]) == 2
    assert "--bundle is ray-config's to set" in capsys.readouterr().err
    assert not out.exists()


# --- the SDKs' own code against the Ray Serve endpoint ---


def test_avrik_sdk_gets_noul_choice_and_score(app_url: str) -> None:
    from avrik_sdk import Client, choice, noul, score

    department = QUESTIONS_JSON[ESCALATED]["criteria"]
    with Client(app_url) as client:
        asked = {KEPT: noul(QUESTIONS_JSON[KEPT]["instructions"]),
                 ESCALATED: choice(QUESTIONS_JSON[ESCALATED]["instructions"], department),
                 "severity": score(SCORE["instructions"], SCORE["criteria"])}
        decision = client.decide(STATE, asked)
        assert 0 <= decision[KEPT].noul <= 1
        assert decision[ESCALATED].choice in department
        assert decision["severity"].legend == {"0": "Minor", "1": "Degraded", "2": "Blocking"}
        assert decision.audit.model_hash and len(decision.audit.input_tokens) == 3
        assert [m.name for m in client.models()] == ["support"]
        assert client.health().status == "ok"


def test_jev_style_gets_routes_from_both_deployments(app_url: str) -> None:
    from jev_style import JevStyle, choice, noul, score

    with JevStyle(base_url=app_url) as jev:
        out = jev.decide(STATE, {"u": noul(QUESTIONS_JSON[KEPT]["instructions"]),
                                 "d": choice(QUESTIONS_JSON[ESCALATED]["instructions"],
                                             QUESTIONS_JSON[ESCALATED]["criteria"]),
                                 "s": score(SCORE["instructions"], SCORE["criteria"])})
    answers = out["answers"]
    assert answers["u"]["x_routing"]["tier"] == "encoder"
    assert answers["d"]["x_routing"]["tier"] == "teacher"
    assert answers["d"]["x_routing"]["upstream"], "the teacher deployment answered it, by URL"
    assert sum(answers["s"]["probabilities"].values()) == pytest.approx(1.0)


def test_typesafe_sdk_gets_its_request_id(app_url: str) -> None:
    from typesafe_sdk import Choice, Noul, RetryPolicy, TypeSafeClient

    with TypeSafeClient(api_key="unused", base_url=app_url, retry=RetryPolicy(max_retries=0)) as client:
        reply = client.system_one(STATE, {
            "u": Noul(instructions=QUESTIONS_JSON[KEPT]["instructions"]),
            "d": Choice(instructions=QUESTIONS_JSON[ESCALATED]["instructions"],
                        criteria=QUESTIONS_JSON[ESCALATED]["criteria"])})
        assert 0 <= reply.nouls["u"].noul <= 1
        assert reply.choices["d"].choice in QUESTIONS_JSON[ESCALATED]["criteria"]
        assert reply.request_id, "Ray's proxy names each request (X-Request-Id), and the app keeps its id"


def test_a_bad_request_is_cascade_serves_422_that_names_the_field(app_url: str) -> None:
    bad = {"state": STATE,
           "questions": {"q": {"type": "choice", "instructions": "Which?", "criteria": ["a"]}}}
    reply = httpx.post(f"{app_url}/v1/systemone", json=bad, headers={"X-Request-Id": "abc-1"}, timeout=60)
    assert reply.status_code == 422, reply.text
    body = reply.json()
    assert body["error"]["code"] == "invalid_request" and body["error"]["field"] == "questions.q.criteria"
    assert body["detail"][0]["loc"] == ["body", "questions", "q", "criteria"]
    assert reply.headers["x-request-id"] == reply.headers["x-typesafe-request-id"] == "abc-1"


def test_a_body_sent_slowly_is_refused_408_at_the_proxy_and_others_get_answers(app_url: str) -> None:
    """Ray's proxy holds a body before a replica gets it (``distill.rayserve.proxy``): a client
    that never finishes sending one gets cascade serve's 408 at the proxy's deadline, and the
    application answers others while it waits."""
    port = int(app_url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10 * RECEIVE_TIMEOUT) as conn:
        conn.sendall(b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"state\": ")
        kept = answered(app_url, {"state": STATE, "questions": {KEPT: QUESTIONS_JSON[KEPT]}})
        reply = b""  # sent nothing more: the proxy's deadline passes, then it closes
        while chunk := conn.recv(4096):
            reply += chunk
    assert kept["answers"][KEPT]["x_routing"]["tier"] == "encoder"
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert b'"request_timeout"' in reply


# --- overload and failure ---


def test_a_burst_that_saturates_the_teacher_is_refused_with_retry_after_and_nothing_is_lost(
        app_url: str) -> None:
    """Forty requests escalating a long state at once: the teacher deployment's queue admits what
    fits its expected wait (``TEACHER_MAX_WAIT``) and refuses the rest at once; every request gets
    an answer or a 503 with Retry-After, and a refused one asked again gets its answer."""
    long_state = STATE + " " + "Nothing in the runbook fixed it and the queue keeps growing. " * 30
    body = {"state": long_state, "questions": {ESCALATED: QUESTIONS_JSON[ESCALATED]}}
    with ThreadPoolExecutor(40) as pool:
        replies = list(pool.map(lambda _: post(app_url, body), range(40)))
    statuses = Counter(reply.status_code for reply in replies)
    assert set(statuses) <= {200, 503} and statuses[503] > 0, statuses
    refused = [reply for reply in replies if reply.status_code == 503]
    assert all(int(reply.headers["retry-after"]) >= 1 for reply in refused)
    assert all(reply.json()["error"]["message"] for reply in refused)
    answered = [reply for reply in replies if reply.status_code == 200]
    assert all(reply.json()["answers"][ESCALATED]["x_routing"]["tier"] == "teacher" for reply in answered)
    retried = post(app_url, body)
    assert retried.status_code == 200, "once the burst has drained, a refused request is answered"


def replicas(deployment: str) -> list[str]:
    """The actor names of ``deployment``'s live replicas (Ray Serve names them ``SERVE_REPLICA::``)."""
    import ray

    named = ray.util.list_named_actors(all_namespaces=True)
    return sorted(actor["name"] for actor in named
                  if actor["name"].startswith(f"SERVE_REPLICA::{deployment}#{deployment}#"))


def test_a_replica_killed_mid_burst_is_replaced_and_no_request_is_lost(app_url: str) -> None:
    """Two hundred requests, eight at a time; one cheap replica killed after the first twenty:
    the requests it held are sent again by the proxy, every one gets its 200, and Ray starts a
    replica in its place."""
    import ray

    body = {"state": STATE, "questions": {KEPT: QUESTIONS_JSON[KEPT]}}
    before = replicas("cascade")
    assert len(before) == 2, before
    with ThreadPoolExecutor(8) as pool:
        burst = [pool.submit(post, app_url, body) for _ in range(200)]
        while sum(reply.done() for reply in burst) < 20:  # mid-burst
            time.sleep(0.01)
        ray.kill(ray.get_actor(before[0], namespace="serve"), no_restart=True)
        replies = [reply.result() for reply in burst]
    assert Counter(reply.status_code for reply in replies) == {200: 200}
    answered_by = Counter(reply.headers["x-cascade-replica"] for reply in replies)
    assert len(answered_by) >= 2, "both replicas answered before the kill"
    deadline = time.monotonic() + READY_S
    while len(replicas("cascade")) < 2 or before[0] in replicas("cascade"):
        assert time.monotonic() < deadline, f"no replica replaced {before[0]}: {replicas('cascade')}"
        time.sleep(0.5)
    wait_ready(f"{app_url}/health")
    assert post(app_url, body).status_code == 200


# --- a promotion rolled out by Ray; one store, one drift watch ---


def demoted_on(url: str) -> tuple[str, float]:
    """The replica that answered ``/metrics`` and its ``cascade_demoted`` gauge for KEPT."""
    reply = httpx.get(f"{url}/metrics", timeout=30)
    line = f'cascade_demoted{{question="{KEPT}"}}'
    value = next((float(row.split()[-1]) for row in reply.text.splitlines() if row.startswith(line)), 0.0)
    return reply.headers["x-cascade-replica"], value


def test_a_bundle_promoted_during_traffic_rolls_out_and_every_request_gets_200(
        deployed: Deployed, bundle_dir: Path, tmp_path: Path) -> None:
    """The config written again with a promoted bundle and run: Ray replaces the replicas one by
    one, each taking traffic only once its models loaded, while clients keep asking."""
    promoted = tmp_path / "support-v2"
    data = Bundle.load(bundle_dir).manifest.model_dump(mode="json")
    Bundle(Manifest.model_validate({**data, "name": "support-v2"}), bundle_dir).save(promoted)
    old = replicas("cascade")
    body = {"state": STATE, "questions": {KEPT: QUESTIONS_JSON[KEPT]}}
    replies: list[httpx.Response] = []
    with ThreadPoolExecutor(4) as pool:
        deployed.deploy(promoted)
        rolling = pool.submit(deployed.rolled, old)
        while not rolling.done():
            replies.extend(pool.map(lambda _: post(deployed.url, body), range(4)))
        rolling.result()
    replies.extend(post(deployed.url, body) for _ in range(4))
    assert Counter(reply.status_code for reply in replies) == {200: len(replies)}
    names = Counter(reply.json()["model"] for reply in replies)
    assert names["support-v2"] >= 4 and set(names) <= {"support", "support-v2"}, names


def test_a_drift_seen_on_one_replica_demotes_the_question_on_all(
        deployed: Deployed, bundle_dir: Path, postgres_url: str) -> None:
    """Both replicas audit every request into one PostgreSQL store (the encoder disagrees with
    gemma on "urgent" about half the time): the drift watch of each reads the other's audits, so
    the question is demoted on both, whichever replica the alarm was raised on."""
    old = replicas("cascade")
    deployed.deploy(bundle_dir, "--audit-store", passwordless(postgres_url), "--audit-share", "1",
                    "--audit-poll", "0.25")
    deployed.rolled(old)
    names = {name.rsplit("#", 1)[1] for name in replicas("cascade")}
    body = {"questions": {KEPT: QUESTIONS_JSON[KEPT]}}
    for item in items(40):
        route = answered(deployed.url, {**body, "state": item.state})["answers"][KEPT]["x_routing"]
        if route["demoted"]:
            break
    demoted: set[str] = set()
    deadline = time.monotonic() + READY_S
    while demoted != names:
        assert time.monotonic() < deadline, f"demoted on {demoted} of {names} only"
        replica, value = demoted_on(deployed.url)
        if value == 1:
            demoted.add(replica)
        time.sleep(0.05)
    for _ in range(6):  # whichever replica answers now, the teacher does, marked demoted
        route = answered(deployed.url, {**body, "state": STATE})["answers"][KEPT]["x_routing"]
        assert (route["tier"], route["demoted"]) == ("teacher", True)


def test_escalations_from_every_replica_are_kept_in_the_one_store(
        deployed: Deployed, bundle_dir: Path, postgres_url: str) -> None:
    """With ``--escalation-share 1`` both replicas keep the teacher's answer to every escalated
    request in one PostgreSQL store, under the client's request id, to retrain on."""
    from distill.store import LabelStore

    old = replicas("cascade")
    deployed.deploy(bundle_dir, "--audit-store", passwordless(postgres_url), "--audit-share", "0",
                    "--escalation-share", "1")
    deployed.rolled(old)
    answered_by: dict[str, str] = {}
    body = {"state": STATE, "questions": {ESCALATED: QUESTIONS_JSON[ESCALATED]}}
    for n in range(30):  # until both replicas have answered some, within a bounded count
        rid = f"esc-{n}"
        reply = httpx.post(f"{deployed.url}/v1/systemone", json=body, headers={"X-Request-Id": rid},
                           timeout=300)
        if reply.status_code == 503:
            time.sleep(int(reply.headers["retry-after"]))
            continue
        assert reply.status_code == 200, reply.text
        assert reply.json()["answers"][ESCALATED]["x_routing"]["tier"] == "teacher"
        answered_by[rid] = reply.headers["x-cascade-replica"]
        if len(answered_by) >= 4 and len(set(answered_by.values())) == 2:
            break
    assert len(set(answered_by.values())) == 2, f"one replica answered all: {answered_by}"
    deadline = time.monotonic() + 60
    while True:
        with LabelStore.open_existing(postgres_url) as store:
            kept = {record.request_id: record for _, record in store.escalations_after(0)}
        if set(answered_by) <= set(kept) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert set(answered_by) <= set(kept), f"kept {sorted(kept)} of {sorted(answered_by)}"
    assert all(set(kept[rid].teacher) == {ESCALATED} and kept[rid].state == STATE for rid in answered_by)


def test_a_promoted_bundle_that_fails_to_load_leaves_the_old_replicas_serving(
        deployed: Deployed, bundle_dir: Path, tmp_path: Path) -> None:
    """A config naming a bundle whose files are not the ones its manifest pins: its replicas refuse
    to start, Ray's ``serve status`` says why, and a replica of the bundle before keeps answering
    meanwhile (Ray's rolling update stopped the other); the good config deployed again takes over."""
    from ray import serve

    broken = tmp_path / "broken"
    shutil.copytree(bundle_dir, broken)
    for _, inside in Bundle.load(broken).manifest.bundle_files():
        (broken / inside.name).write_bytes(b"not what the manifest names")
    old = replicas("cascade")
    body = {"state": STATE, "questions": {KEPT: QUESTIONS_JSON[KEPT]}}
    deployed.deploy(broken)
    codes: Counter[int] = Counter()
    deadline = time.monotonic() + READY_S
    while True:
        codes[post(deployed.url, body).status_code] += 1
        app = serve.status().applications["cascade"]
        said = " ".join([app.message, *(d.message for d in app.deployments.values())])
        if "failed" in said.lower():
            break
        assert time.monotonic() < deadline, f"Ray never said the update failed: {said!r}"
        time.sleep(1)
    assert "sha256" in said, f"Ray's status names the bundle's own refusal: {said!r}"
    assert codes == {200: sum(codes.values())}, codes
    assert set(old) & set(replicas("cascade")), "the bundle before kept a replica serving"
    deployed.deploy(bundle_dir)
    wait_ready(f"{deployed.url}/health")
    assert post(deployed.url, body).status_code == 200


# --- the KubeRay manifest (checked here against Ray's schema; kubectl needs a cluster: not run) ---

MANIFEST = Path(__file__).resolve().parents[1] / "deploy" / "kuberay" / "rayservice.yaml"


def test_the_kuberay_manifest_is_the_config_ray_config_writes_and_ray_accepts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ray as ray_core
    from ray.serve.schema import ServeDeploySchema

    from distill.cli.serve.replicas import serve_args

    manifest = yaml.safe_load(MANIFEST.read_text())
    assert (manifest["apiVersion"], manifest["kind"]) == ("ray.io/v1", "RayService")
    config = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    parsed = ServeDeploySchema.model_validate(config)  # Ray Serve's own schema of a config
    for app in parsed.applications:
        module, name = app.import_path.split(":")
        assert callable(getattr(__import__(module, fromlist=[name]), name)), app.import_path
        serve_args(app.args["argv"])  # flags a replica takes
    monkeypatch.setenv("CASCADE_API_KEY", "k")  # the manifest's host is open: a key is checked
    out = tmp_path / "serve.yaml"
    assert main(["ray-config", "--bundle", "/models/support", "--teacher", "/models/qwen3.5-4b-q4_k_m.gguf",
                 "--teacher-gpus", "1", "--teacher-cpus", "4", "--host", "0.0.0.0", "--min-replicas", "2",
                 "--max-replicas", "16", "--out", str(out), "--", "--audit-store",
                 "postgresql://cascade@postgres:5432/labels", "--audit-share", "0.02"]) == 0
    assert config == yaml.safe_load(out.read_text()), "the manifest holds what its header's command writes"
    cluster = manifest["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == ray_core.__version__
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    for group in groups:
        for container in group["template"]["spec"]["containers"]:
            env = {item["name"]: item for item in container["env"]}
            assert env[VARIABLE]["value"] == IMPORT_PATH
    gpus = [group for group in groups if "nvidia.com/gpu" in str(group)]
    teacher = next(app for app in config["applications"] if app["name"] == "teacher")
    assert len(gpus) == 1 and teacher["deployments"][0]["ray_actor_options"]["num_gpus"] == 1.0
