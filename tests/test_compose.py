"""These tests keep the deployment files honest without an engine or a cluster: every command
exists in our CLI, every variable is one our settings read, and the ports, URLs, queue names
and grace periods agree with each other and with the code. (tests/test_containers.py runs the
compose file on a real Docker engine: make test-containers.)"""

from __future__ import annotations

import argparse
import fnmatch
import json
import re
import shlex
import tomllib
from dataclasses import fields
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from broker.settings import Settings
from interactor.autoscale import AUTOSCALER_METRIC_NAMES
from interactor.cli import build_parser
from broker.queueing import sub_queues
from interactor.metrics import METRIC_NAMES
from producer.planning import plan_job
from tests.conftest import ROOT

pytestmark = pytest.mark.unit  # needs no server: make check runs it

ALLOWED_ENV = {"INTERACTOR_" + f.name.upper() for f in fields(Settings)} | {"REDIS_URL", "OPENAI_API_KEY"}
_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")
# The variables compose requires (no default: no fleet runs on a password written in the file).
REQUIRED = {"REDIS_PASSWORD": "redis-pw", "POSTGRES_PASSWORD": "pg-pw"}


class MissingVariable(Exception):
    pass


# --- helpers ---------------------------------------------------------------------------------
def interpolate(value, env: dict | None = None):
    """Compose's variable substitution: defaults apply to what ``env`` lacks; a required
    variable (``${X:?message}``) that is missing raises MissingVariable."""
    env = env or {}
    if isinstance(value, str):
        def sub(m):
            if m.group(0) == "$$":
                return "$"
            name, op, default = m.group(1), m.group(2), m.group(3)
            got = env.get(name)
            if op == ":-":
                return got if got else (default or "")
            if op == "-":
                return got if got is not None else (default or "")
            if op in (":?", "?") and (got is None or (op == ":?" and not got)):
                raise MissingVariable(f"{name}: {default}")
            return got or ""
        return _VAR.sub(sub, value)
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    return value


def argv(command) -> list[str]:
    return shlex.split(command) if isinstance(command, str) else [str(c) for c in command]


def flag(args: list[str], name: str) -> str | None:
    """Value of ``--name V`` or ``--name=V``."""
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def parse_cli(args: list[str], where: str) -> argparse.Namespace:
    assert args and args[0] == "interactor", f"{where}: {args} does not run our CLI"
    try:
        ns = build_parser().parse_args(args[1:])
    except SystemExit:
        pytest.fail(f"{where}: `{' '.join(args)}` is not a valid interactor command")
    if hasattr(ns, "rest"):  # a stand-in taking its own flags (serve-model)
        from examples.envserver import add_fault_args

        p = argparse.ArgumentParser(exit_on_error=False)
        add_fault_args(p)
        try:
            p.parse_args(ns.rest)
        except (argparse.ArgumentError, SystemExit):
            pytest.fail(f"{where}: bad flags for the stand-in: {ns.rest}")
    return ns


def duration_s(text) -> float:
    if isinstance(text, (int, float)):
        return float(text)
    total, units = 0.0, {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", str(text))
    assert parts and "".join(n + u for n, u in parts) == str(text), f"bad duration {text!r}"
    for n, u in parts:
        total += float(n) * units[u]
    return total


def listen_port(args: list[str]) -> set[int]:
    """Ports a command listens on, from its flags."""
    out = set()
    for name in ("--port", "--metrics-port"):
        v = flag(args, name)
        if v and v != "0":
            out.add(int(v))
    return out


def container_port(mapping) -> int:
    if isinstance(mapping, dict):
        return int(mapping["target"])
    return int(str(mapping).split(":")[-1].split("/")[0])


@pytest.fixture(scope="module")
def compose() -> dict:
    raw = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return interpolate(raw, REQUIRED)


def ours(service: dict) -> bool:
    return "build" in service


# --- docker-compose.yml ------------------------------------------------------------------------
def test_compose_commands_exist_in_our_cli(compose):
    services = compose["services"]
    expected = {
        "worker": "interactor worker",
        "consumer": "interactor consumer",
        "producer": "interactor submit /tasks/tasks.yaml",
        "env": "interactor serve-env --host 0.0.0.0 --port 8080",
        "model": "interactor serve-model --host 0.0.0.0 --port 8000",
    }
    for name, command in expected.items():
        assert argv(services[name]["command"]) == shlex.split(command), name
    assert argv(services["autoscaler"]["command"])[:2] == ["interactor", "autoscale"]
    assert argv(services["metrics"]["command"])[:2] == ["interactor", "metrics"]
    for name, svc in services.items():
        if ours(svc):
            parse_cli(argv(svc["command"]), f"service {name}")
    assert services["flower"]["image"].startswith("mher/flower")
    assert argv(services["flower"]["command"])[0] == "celery" and "flower" in argv(services["flower"]["command"])


def test_compose_environment_is_what_settings_read(compose):
    for name, svc in compose["services"].items():
        if not ours(svc):
            continue
        env = svc.get("environment") or {}
        assert isinstance(env, dict), f"{name}: use the mapping form for environment"
        unknown = set(env) - ALLOWED_ENV
        assert not unknown, f"service {name} sets variables no setting reads: {sorted(unknown)}"
        Settings.from_env({k: str(v) for k, v in env.items()})  # and their values are valid


def test_compose_ports_and_urls_agree(compose):
    services = compose["services"]
    redis_args = argv(services["redis"]["command"])
    redis_port = int(flag(redis_args, "--port") or 6379)
    password = flag(redis_args, "--requirepass")
    listening = {name: listen_port(argv(svc["command"])) for name, svc in services.items() if "command" in svc}
    listening["redis"] = {redis_port}
    listening["postgres"] = {5432}
    pg_password = services["postgres"]["environment"]["POSTGRES_PASSWORD"]

    def check_url(url: str, where: str) -> None:
        parts = urlsplit(url)
        assert parts.hostname in services, f"{where}: {url} names no service"
        port = parts.port or {"redis": 6379, "http": 80, "https": 443, "postgresql": 5432}[parts.scheme]
        assert port in listening[parts.hostname], f"{where}: {url} but {parts.hostname} listens on {listening[parts.hostname]}"
        if parts.scheme == "redis":
            assert parts.password == password, f"{where}: the Redis password differs from the server's"
        if parts.scheme == "postgresql":
            assert parts.password == pg_password and parts.username == services["postgres"]["environment"]["POSTGRES_USER"]
            assert parts.path.lstrip("/") == services["postgres"]["environment"]["POSTGRES_DB"], where

    settings_urls = 0
    for name, svc in services.items():
        for key, value in (svc.get("environment") or {}).items():
            if ours(svc) and isinstance(value, str) and re.match(r"^(redis|https?|postgresql)://", value):
                check_url(value, f"{name}.{key}")
                settings_urls += 1
        for mapping in svc.get("ports") or []:
            if ours(svc) or name == "flower":
                assert container_port(mapping) in listening[name], f"{name} publishes {mapping}, listens on {listening[name]}"
    assert settings_urls >= 3
    env = services["worker"]["environment"]
    assert urlsplit(env["INTERACTOR_LLM_BASE_URL"]).path == "/v1"  # OpenAI base URL of the stand-in
    check_url(flag(argv(services["flower"]["command"]), "--broker"), "flower --broker")
    assert flag(argv(services["flower"]["command"]), "--broker") == env["REDIS_URL"]
    # Health checks probe the ports the services listen on.
    env_probe = " ".join(services["env"]["healthcheck"]["test"])
    assert re.search(r"http://127\.0\.0\.1:(\d+)/envs", env_probe).group(1) == flag(argv(services["env"]["command"]), "--port")
    redis_probe = " ".join(services["redis"]["healthcheck"]["test"])
    # The probe reads the password from the container's environment ($$ in the file).
    assert f"-p {redis_port}" in redis_probe and "$REDIS_PASSWORD" in redis_probe
    assert services["redis"]["environment"]["REDIS_PASSWORD"] == password
    pg_probe = services["postgres"]["healthcheck"]["test"]
    assert pg_probe[1] == "pg_isready" and flag(pg_probe, "-U") == services["postgres"]["environment"]["POSTGRES_USER"]
    model_probe = " ".join(services["model"]["healthcheck"]["test"])
    assert re.search(r"http://127\.0\.0\.1:(\d+)/v1/models", model_probe).group(1) == flag(argv(services["model"]["command"]), "--port")
    # Prometheus scrapes what the exporters serve; Grafana reads that Prometheus.
    prom = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    targets = [t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]]
    assert "metrics:9400" in targets
    for t in targets:
        host, port = t.split(":")
        assert host in services and int(port) in listening[host], t
    ds = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    check_prom = urlsplit(ds["datasources"][0]["url"])
    assert check_prom.hostname == "prometheus" and container_port(services["prometheus"]["ports"][0]) == check_prom.port
    prov = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/interactor.yml").read_text())
    mounted = {v.split(":")[1]: v.split(":")[0] for v in services["grafana"]["volumes"]}
    dash_dir = prov["providers"][0]["options"]["path"]
    assert (ROOT / mounted[dash_dir] / "interactor.json").exists()


def test_compose_redis_workers_and_one_shot_producer(compose):
    services = compose["services"]
    redis_args = argv(services["redis"]["command"])
    assert flag(redis_args, "--appendonly") == "yes"
    assert flag(redis_args, "--maxmemory-policy") == "noeviction"
    assert services["redis"]["healthcheck"]["test"]
    assert any(v.endswith(":/data") for v in services["redis"]["volumes"])
    for name, svc in services.items():
        if ours(svc) and name not in ("env", "model"):
            assert svc["depends_on"]["redis"]["condition"] == "service_healthy", name
    # The store: PostgreSQL on a volume, two consumers that start once it answers.
    assert any(v.endswith(":/var/lib/postgresql/data") for v in services["postgres"]["volumes"])
    assert services["consumer"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert services["consumer"]["scale"] == 2
    assert Settings.from_env({k: str(v) for k, v in services["consumer"]["environment"].items()}).store_url.startswith("postgresql://")

    for name in ("worker", "autoscaler"):
        svc = services[name]
        # Scalable: nothing that must be unique per container.
        assert "container_name" not in svc and not svc.get("ports"), name
        env = Settings.from_env({k: str(v) for k, v in svc["environment"].items()})
        grace = duration_s(svc["stop_grace_period"])
        assert env.shutdown_grace_s >= env.episode_budget_s, "a warm shutdown must let an episode use its budget"
        assert grace > env.shutdown_grace_s + 60, f"{name}: Docker would kill before the warm shutdown ends"
    assert "autoscale" in services["autoscaler"]["profiles"]
    assert {"demo"} <= set(services["env"]["profiles"]) and {"demo"} <= set(services["model"]["profiles"])

    producer = services["producer"]
    assert producer["restart"] == "no"
    mounts = {v.split(":")[1]: v.split(":")[0] for v in producer["volumes"]}
    task_file = argv(producer["command"])[2]
    host_dir = ROOT / mounts[str(Path(task_file).parent)]
    assert (host_dir / Path(task_file).name).exists()
    # The bundled tasks plan with the producer's settings (entries without base_url get
    # INTERACTOR_ENV_BASE_URL, which names the demo env server).
    settings = Settings.from_env({k: str(v) for k, v in producer["environment"].items()})
    planned = plan_job([str(host_dir / Path(task_file).name)], job_id="compose-check",
                       default_base_url=settings.env_base_url, default_queue=settings.queue)
    assert planned.episodes and {e.base_url for e in planned.episodes} == {"http://env:8080"}
    assert {e.queue for e in planned.episodes} == {settings.queue}


def test_compose_requires_passwords_and_runs_on_both_compose_versions():
    raw = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    # No password written in the file: without them, compose refuses to start.
    for name in REQUIRED:
        with pytest.raises(MissingVariable, match=name):
            interpolate(raw, {k: v for k, v in REQUIRED.items() if k != name})
    assert "interactor@redis" not in (ROOT / "docker-compose.yml").read_text()
    # docker-compose 1.29 (Debian's) knows no top-level `name:`; the project name comes from
    # -p / COMPOSE_PROJECT_NAME.
    assert "name" not in raw
    # Third-party images can be replaced (a mirror, or the Debian-made images of
    # tests/test_containers.py); the defaults are what users get.
    defaults = {"redis": "redis:7.2-alpine", "postgres": "postgres:16-alpine", "flower": "mher/flower:2.0",
                "prometheus": "prom/prometheus:v2.53.0", "grafana": "grafana/grafana:11.1.0",
                **{name: "redis:7.2-alpine" for name in ("redis-replica", "sentinel1", "sentinel2", "sentinel3")}}
    for name, svc in raw["services"].items():
        if "build" in svc:
            assert svc["image"] == "${INTERACTOR_IMAGE:-interactor:latest}", name
        else:
            assert re.fullmatch(r"\$\{[A-Z_]+_IMAGE:-[^}]+\}", svc["image"]), name
            assert interpolate(svc["image"]) == defaults[name]
    assert interpolate(raw["services"]["redis"]["image"], {"REDIS_IMAGE": "mirror/redis:7"}) == "mirror/redis:7"


@pytest.mark.skipif(not Path("/usr/bin/docker-compose").exists(), reason="Debian's docker-compose is not installed")
def test_compose_file_is_valid_for_docker_compose_1_29(tmp_path):
    import subprocess

    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), **REQUIRED}
    r = subprocess.run(["/usr/bin/docker-compose", "-p", "check", "-f", str(ROOT / "docker-compose.yml"),
                        "--profile", "demo", "--profile", "autoscale", "--profile", "monitoring", "--profile", "sentinel",
                        "config", "-q"],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    r = subprocess.run(["/usr/bin/docker-compose", "-p", "check", "-f", str(ROOT / "docker-compose.yml"), "config", "-q"],
                       env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "REDIS_PASSWORD" in r.stderr


# The sentinel profile's settings, as the compose file's header and docs/deployment.md give them.
SENTINEL_ENV = {"REDIS_SCHEME": "redis+sentinel",
                "REDIS_ADDRESS": "sentinel1:26379,sentinel2:26379,sentinel3:26379/interactor/0"}


def _sentinel_conf(service: dict) -> dict[str, list[str]]:
    """A Sentinel service's configuration, from the file its command writes: directive -> words."""
    script = argv(service["command"])[-1]
    body = script.split("<<EOF\n", 1)[1].split("\nEOF", 1)[0]
    return {" ".join(line.split()[:2]) if line.startswith("sentinel ") else line.split()[0]:
            line.split()[2 if line.startswith("sentinel ") else 1:] for line in body.splitlines() if line.strip()}


def test_compose_sentinel_profile_is_a_replica_and_three_sentinels_the_fleet_finds():
    from broker.redisurl import parse_redis_url

    raw = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = interpolate(raw, {**REQUIRED, **SENTINEL_ENV})["services"]
    password = REQUIRED["REDIS_PASSWORD"]
    sentinels = [n for n in services if n.startswith("sentinel")]
    assert sentinels == ["sentinel1", "sentinel2", "sentinel3"]
    for name in ["redis-replica", *sentinels]:
        assert services[name]["profiles"] == ["sentinel"], name
    # The fleet's URL names these Sentinels, at the port they listen on, and the service they watch.
    env = services["worker"]["environment"]
    s = Settings.from_env({k: str(v) for k, v in env.items()})
    address = parse_redis_url(s.redis_url)
    assert address is not None and address.password == password
    assert s.redis_sentinel_password.reveal() == password
    for name in sentinels:
        conf = _sentinel_conf(services[name])
        assert services[name]["hostname"] == name and (name, int(conf["port"][0])) in address.sentinels
        host, port, quorum = conf["sentinel monitor"][1:]
        assert conf["sentinel monitor"][0] == address.service
        assert (host, int(port)) == ("redis", int(flag(argv(services["redis"]["command"]), "--port")))
        assert int(quorum) == len(sentinels) // 2 + 1  # a majority decides a failover
        assert conf["sentinel auth-pass"][1] == conf["requirepass"][0] == conf["sentinel sentinel-pass"][0] \
            == "$REDIS_PASSWORD"  # read from the container's environment at start
        assert services[name]["environment"]["REDIS_PASSWORD"] == password
        assert argv(services[name]["command"])[-1].rstrip().endswith("exec redis-server /tmp/sentinel.conf --sentinel")
    assert len(address.sentinels) == len(sentinels)
    # The replica follows redis, with its password, persisted and never evicting like it; each
    # data server is announced to the Sentinels by its service name.
    replica = argv(services["redis-replica"]["command"])
    primary = argv(services["redis"]["command"])
    assert replica[replica.index("--replicaof") + 1:replica.index("--replicaof") + 3] == ["redis", "6379"]
    for args, name in ((replica, "redis-replica"), (primary, "redis")):
        assert flag(args, "--masterauth") == flag(args, "--requirepass") == password
        assert flag(args, "--appendonly") == "yes" and flag(args, "--maxmemory-policy") == "noeviction"
        assert flag(args, "--replica-announce-ip") == name
    # What the header and the deployment guide tell users to set is what this test set.
    for doc in ((ROOT / "docker-compose.yml").read_text(), (ROOT / "docs/deployment.md").read_text()):
        for k, v in SENTINEL_ENV.items():
            assert f"{k}={v}" in doc, k
    # Without them the fleet uses the one Redis, as before.
    plain = interpolate(raw, REQUIRED)["services"]["worker"]["environment"]["REDIS_URL"]
    assert plain == f"redis://:{password}@redis:6379/0"


def test_dockerfile_builds_the_project():
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "ENTRYPOINT" not in dockerfile, "compose commands start with `interactor`"
    assert re.search(r"pip wheel .* \.\s*$", dockerfile, re.M) and "pip install" in dockerfile
    # Users get python:3.11-slim; the container tests pass a base made from Debian's packages.
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim$", dockerfile, re.M)
    froms = re.findall(r"^FROM (\S+)", dockerfile, re.M)
    assert froms == ["${BASE_IMAGE}", "${BASE_IMAGE}"], froms
    assert re.search(r"^USER interactor$", dockerfile, re.M), "runs as non-root"
    ignored = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = [p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]]
    assert any(d.startswith("prometheus-client") for d in project["project"]["dependencies"])
    for path in packages + ["pyproject.toml", "examples/tasks.yaml", "examples/data"]:
        assert (ROOT / path).exists(), path
        assert not any(fnmatch.fnmatch(path, pat) for pat in ignored), f".dockerignore drops {path}"


# --- Kubernetes + KEDA -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def k8s() -> dict:
    kust = yaml.safe_load((ROOT / "deploy/k8s/kustomization.yaml").read_text())
    docs = []
    for name in kust["resources"]:
        docs += [d for d in yaml.safe_load_all((ROOT / "deploy/k8s" / name).read_text()) if d]
    docs += list(yaml.safe_load_all((ROOT / "deploy/k8s/secret.example.yaml").read_text()))
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def _containers(k8s):
    for (kind, name), d in k8s.items():
        if kind in ("Deployment", "StatefulSet"):
            for c in d["spec"]["template"]["spec"]["containers"]:
                yield f"{kind}/{name}", d, c


def test_k8s_settings_commands_and_ports(k8s):
    cm = k8s[("ConfigMap", "interactor-settings")]["data"]
    secret = k8s[("Secret", "interactor-secrets")]["stringData"]
    assert set(cm) <= ALLOWED_ENV, set(cm) - ALLOWED_ENV
    settings = Settings.from_env({**cm, "REDIS_URL": secret["redis-url"]})
    n = 0
    for where, d, c in _containers(k8s):
        if c["image"] != "interactor":
            continue
        n += 1
        parse_cli(c["command"] + c.get("args", []), where)
        names = {e["name"] for e in c.get("env", [])}
        assert names <= ALLOWED_ENV, f"{where}: {names - ALLOWED_ENV}"
        assert "REDIS_URL" in names, where
        for e in c.get("env", []):
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                assert ref["key"] in secret, f"{where}: no key {ref['key']} in the secret"
        ports = listen_port(c["command"])
        for p in c.get("ports", []):
            assert p["containerPort"] in ports, where
        ann = d["spec"]["template"]["metadata"].get("annotations", {})
        if "prometheus.io/port" in ann:
            assert int(ann["prometheus.io/port"]) in ports
    assert n == 4  # worker, consumer, metrics, gateway
    svc = k8s[("Service", "interactor-metrics")]["spec"]["ports"][0]
    assert svc["targetPort"] == 9400 and svc["port"] == 9400
    svc = k8s[("Service", "interactor-gateway")]["spec"]["ports"][0]
    assert svc["targetPort"] == 8600 and svc["port"] == 8600
    redis_url = urlsplit(secret["redis-url"])
    assert redis_url.hostname == "redis" and redis_url.password == secret["redis-password"]
    assert redis_url.port == k8s[("Service", "redis")]["spec"]["ports"][0]["port"]
    assert settings.queue == "episodes"


def test_k8s_workers_scale_on_the_queue_and_drain_before_they_die(k8s):
    cm = k8s[("ConfigMap", "interactor-settings")]["data"]
    settings = Settings.from_env(cm)
    worker = k8s[("Deployment", "interactor-worker")]
    spec = worker["spec"]["template"]["spec"]
    assert spec["containers"][0]["command"] == ["interactor", "worker"]
    assert settings.shutdown_grace_s >= settings.episode_budget_s
    assert spec["terminationGracePeriodSeconds"] > settings.shutdown_grace_s + 60
    assert worker["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0

    so = k8s[("ScaledObject", "interactor-worker")]["spec"]
    assert so["scaleTargetRef"]["name"] == "interactor-worker"
    assert 0 <= so["minReplicaCount"] <= so["maxReplicaCount"]
    triggers = so["triggers"]
    assert {t["type"] for t in triggers} == {"redis"}
    # Every list kombu uses for the queue's priorities, exactly.
    assert sorted(t["metadata"]["listName"] for t in triggers) == sorted(n for _, n in sub_queues(settings.queue))
    mods = so["advanced"]["scalingModifiers"]
    assert set(re.findall(r"[a-z]\w*", mods["formula"])) == {t["name"] for t in triggers}
    assert "+" in mods["formula"] and mods["metricType"] == "AverageValue"
    assert int(mods["target"]) == settings.concurrency  # per-worker target = episodes a worker runs at once
    for t in triggers:
        assert int(t["metadata"]["listLength"]) == settings.concurrency
        host, port = t["metadata"]["address"].split(":")
        assert host.split(".")[0] == "redis" and int(port) == k8s[("Service", "redis")]["spec"]["ports"][0]["port"]
        assert t["authenticationRef"]["name"] in {n for k, n in k8s if k == "TriggerAuthentication"}
    auth = next(d for (k, _), d in k8s.items() if k == "TriggerAuthentication")
    secret = k8s[("Secret", "interactor-secrets")]["stringData"]
    assert all(ref["key"] in secret for ref in auth["spec"]["secretTargetRef"])
    behavior = so["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleUp"]["stabilizationWindowSeconds"] == 0
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] > 0
    # Redis is persistent and never evicts (a task list evicted is an episode lost).
    redis_args = k8s[("StatefulSet", "interactor-redis")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert flag(redis_args, "--appendonly") == "yes" and flag(redis_args, "--maxmemory-policy") == "noeviction"


# --- the dashboard and the docs use the metric names the code exports ------------------------
def _families_in(text: str) -> set[str]:
    known = set(METRIC_NAMES) | set(AUTOSCALER_METRIC_NAMES)
    found = set()
    for name in re.findall(r"\binteractor_[a-z0-9_]+", text):
        for cand in (name, re.sub(r"_(total|bucket|sum|count)$", "", name)):
            if cand in known:
                found.add(cand)
                break
        else:
            pytest.fail(f"{name} is not a metric interactor exports")
    return found


def test_grafana_dashboard_uses_exported_metrics():
    dash = json.loads((ROOT / "deploy/grafana/dashboards/interactor.json").read_text())
    exprs = []

    def walk(panels):
        for p in panels:
            exprs.extend(t["expr"] for t in p.get("targets", []))
            walk(p.get("panels", []))

    walk(dash["panels"])
    used = _families_in("\n".join(exprs))
    for must in ("interactor_queue_depth", "interactor_episodes_running", "interactor_steps",
                 "interactor_step_latency_seconds", "interactor_episode_duration_seconds",
                 "interactor_attempt_failures", "interactor_dead_letters", "interactor_results_lag",
                 "interactor_job_progress_ratio"):
        assert must in used, must


def test_deployment_doc_names_every_metric_and_file():
    doc = (ROOT / "docs/deployment.md").read_text()
    missing = set(METRIC_NAMES) - _families_in(doc)
    assert not missing, f"docs/deployment.md does not describe {sorted(missing)}"
    for path in ("docker-compose.yml", "deploy/k8s/keda.yaml", "deploy/k8s/worker.yaml",
                 "deploy/grafana/dashboards/interactor.json"):
        assert path in doc and (ROOT / path).exists(), path
