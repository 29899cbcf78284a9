"""deploy/: the Kubernetes manifests against the Kubernetes API schemas (kubernetes-validate),
the Envoy configuration against Envoy's API (envoy-data-plane: unknown fields, enum values and
typed configs are refused), and every Blink command line in them (systemd units, container
args) parsed by Blink's own CLI, so a renamed or mistyped flag fails here."""
from __future__ import annotations

import argparse
import configparser
import importlib
import ipaddress
import re
import shlex
import signal
from pathlib import Path

import pytest

from blink.client.cli import _check_metrics_ports, build_parser
from blink.client.sdk import SESSION_HEADER
from blink.nic_service.server import SERVICE_NAME
from blink.ring.layout import RingGeometry
from blink.ring.lifecycle import STOP_SIGNALS

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S_VERSION = "1.30.0"
ENVOY_TYPED_CONFIGS = ("envoy.extensions.filters.network.http_connection_manager.v3",
                       "envoy.extensions.filters.http.router.v3",
                       "envoy.extensions.upstreams.http.v3",
                       "envoy.extensions.retry.host.previous_hosts.v3")


def parse_blink(argv: list[str]):
    args = build_parser().parse_args(argv)
    assert args.model and args.log_format == "json"
    return args


def test_kubernetes_manifests():
    kv = pytest.importorskip("kubernetes_validate", reason="the test extra is not installed")
    import yaml
    docs = list(yaml.safe_load_all((DEPLOY / "k8s" / "blink.yaml").read_text()))
    assert [d["kind"] for d in docs] == ["Deployment", "Service", "PodDisruptionBudget"]
    for doc in docs:
        kv.validate(doc, K8S_VERSION, strict=True)  # raises on any schema violation
    pod = docs[0]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = parse_blink(container["args"])
    assert container["command"] == ["blink"] and args.command == "serve"
    # preStop's wait, the drain and the engine's stop (10 s at most, README) fit the grace
    wait = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert wait + args.shutdown_timeout + 10 < pod["terminationGracePeriodSeconds"]
    assert args.slots >= args.max_num_seqs  # a running request holds a slot
    # a replica per GPU: a rollout must not need a GPU more than the replicas hold
    assert docs[0]["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0
    assert container["readinessProbe"]["grpc"] == {"port": args.port,
                                                   "service": SERVICE_NAME}
    assert str(args.metrics_port) == docs[0]["spec"]["template"]["metadata"]["annotations"][
        "prometheus.io/port"]
    assert docs[1]["spec"]["clusterIP"] == "None"  # headless: Envoy sees every pod


def test_envoy_config():
    pytest.importorskip("envoy_data_plane", reason="the test extra is not installed")
    import yaml
    for module in ENVOY_TYPED_CONFIGS:
        importlib.import_module(f"envoy_data_plane.{module}")
    from envoy_data_plane.envoy.config.bootstrap.v3 import Bootstrap
    config = yaml.safe_load((DEPLOY / "envoy" / "envoy.yaml").read_text())
    Bootstrap().from_dict(config)  # raises on unknown fields, bad enums, unknown types
    cluster = config["static_resources"]["clusters"][0]
    assert cluster["health_checks"][0]["grpc_health_check"]["service_name"] == SERVICE_NAME
    k8s_service = "blink.default.svc.cluster.local"
    address = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"][
        "address"]["socket_address"]
    assert (address["address"], address["port_value"]) == (k8s_service, 50051)
    routes = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"]["route_config"]["virtual_hosts"][0]["routes"]
    # a refused stream (a draining replica) is retried on another replica, either route
    for route in routes:
        assert [p["name"] for p in route["route"]["retry_policy"]["retry_host_predicate"]] == [
            "envoy.retry_host_predicates.previous_hosts"]
    # a stream with the SDK's session header (first: routes match in order) goes to the replica
    # its value hashes to; any other to the least busy one; the same replicas and checks
    by_session, default = routes
    assert by_session["match"]["headers"] == [{"name": SESSION_HEADER, "present_match": True}]
    assert by_session["route"]["hash_policy"] == [{"header": {"header_name": SESSION_HEADER}}]
    assert "headers" not in default["match"] and "hash_policy" not in default["route"]
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    assert (clusters[by_session["route"]["cluster"]]["lb_policy"],
            clusters[default["route"]["cluster"]]["lb_policy"]) == ("MAGLEV", "LEAST_REQUEST")
    # bounded loads: a replica holding many sessions passes new ones on (Envoy's minimum 100)
    assert clusters["blink_by_session"]["common_lb_config"]["consistent_hashing_lb_config"][
        "hash_balance_factor"] >= 100
    for key in ("health_checks", "typed_extension_protocol_options", "type"):
        assert clusters["blink"][key] == clusters["blink_by_session"][key]
    assert clusters["blink"]["load_assignment"]["endpoints"] == \
        clusters["blink_by_session"]["load_assignment"]["endpoints"]
    with pytest.raises((KeyError, ValueError, TypeError)):  # the check has teeth
        Bootstrap().from_dict({**config, "admin": {"adress": {}}})


def systemd_unit(name: str):
    """A unit of deploy/systemd and its ExecStart parsed by Blink's CLI."""
    unit = configparser.ConfigParser(strict=True, interpolation=None)
    unit.optionxform = str
    unit.read(DEPLOY / "systemd" / f"{name}.service")
    assert {"Unit", "Service", "Install"} <= set(unit.sections())
    argv = shlex.split(unit["Service"]["ExecStart"])
    assert argv[0].endswith("/blink")
    return unit, parse_blink(argv[1:])


def test_systemd_units():
    (engine_unit, engine), (frontend_unit, frontend) = map(systemd_unit, ("blink-engine",
                                                                          "blink-frontend"))
    assert (engine.command, frontend.command) == ("engine", "frontend")
    assert engine.transport == frontend.transport == "shm"
    assert engine.ring_name == frontend.ring_name and engine.model == frontend.model
    assert engine.slots >= engine.max_num_seqs  # a running request holds a slot
    # stopped in reverse start order: the front end (After= the engine) drains first
    assert "blink-engine.service" in frontend_unit["Unit"]["After"]
    assert float(frontend_unit["Service"]["TimeoutStopSec"]) > frontend.shutdown_timeout
    # beside busy neighbours the front end keeps its throughput only ahead of them (README)
    assert int(frontend_unit["Service"]["Nice"]) < 0 and frontend.workers > 1


def test_dpu_host_systemd_units():
    """deploy/README.md's DPU + host pair: the engine on the host serves its ring by RDMA where
    the front end on the DPU dials it; both may pin memory (ring registration)."""
    (engine_unit, engine), (frontend_unit, frontend) = map(
        systemd_unit, ("blink-engine-rdma", "blink-frontend-dpu"))
    assert (engine.command, frontend.command) == ("engine", "frontend")
    assert engine.transport == frontend.transport == "rdma"
    assert engine.rdma_addr == frontend.rdma_addr and engine.rdma_addr[0] != "0.0.0.0"
    assert engine.model == frontend.model   # the same path on both machines (README)
    assert engine_unit["Service"]["LimitMEMLOCK"] == frontend_unit["Service"]["LimitMEMLOCK"] \
        == "infinity"
    # two machines: neither unit waits for the other (the front end dials until it answers)
    assert "blink-engine" not in frontend_unit["Unit"].get("After", "")
    assert float(frontend_unit["Service"]["TimeoutStopSec"]) > frontend.shutdown_timeout


# --- the deploy files against the code as it is: engine, paths, ring, probes, metrics, Envoy ----

ALL_UNITS = ("blink-engine", "blink-frontend", "blink-engine-rdma", "blink-frontend-dpu")
ENGINE_UNITS = ("blink-engine", "blink-engine-rdma")
FRONTEND_UNITS = ("blink-frontend", "blink-frontend-dpu")
# the context the manifests' model serves without --max-model-len: Llama-3.1-8B's
# max_position_embeddings (the ring holds a whole prompt and a whole output per slot)
MODEL_CONTEXT = 131_072
# what serve gives a stopping engine (README, "Drain"); a unit's engine gets at least as long
ENGINE_STOP_S = 10


def k8s_docs() -> list[dict]:
    import yaml
    return list(yaml.safe_load_all((DEPLOY / "k8s" / "blink.yaml").read_text()))


def envoy_config() -> dict:
    import yaml
    return yaml.safe_load((DEPLOY / "envoy" / "envoy.yaml").read_text())


def quantity_bytes(text: str) -> int:
    """A Kubernetes memory quantity (binary suffixes) in bytes."""
    number, suffix = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti)?", str(text)).groups()
    return int(number) << {None: 0, "Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40}[suffix]


def effective_metrics_host(args) -> str:
    """Where the front end serves its metrics, as the CLI resolves an unset --metrics-host."""
    resolved = argparse.Namespace(**vars(args))
    resolved.metrics_port = None  # (resolve the host only: bind nothing)
    _check_metrics_ports(resolved)
    return resolved.metrics_host


def test_gpu_engines_are_pinned_to_cuda():
    """A GPU deployment fails loudly without its GPU: --engine auto falls back to the CPU
    NumPy engine (an info line) where cuda-python, nvcc or the GPU is missing, and would serve
    an 8B model there (deploy/setup.sh alone does not install the gpu extra)."""
    for name in ENGINE_UNITS:
        assert systemd_unit(name)[1].engine == "cuda", name
    (container,) = k8s_docs()[0]["spec"]["template"]["spec"]["containers"]
    assert parse_blink(container["args"]).engine == "cuda"


def test_engine_cache_dir_is_writable():
    """The CUDA engine writes compiled kernels and GEMM choices under $BLINK_CACHE_DIR, else
    ~/.cache/blink: a system user (useradd --system, as the units ask) has no home there, and
    the engine's mkdir failed at start: systemd's CacheDirectory, made for the unit's user."""
    for name in ENGINE_UNITS:
        service = systemd_unit(name)[0]["Service"]
        env = dict(item.split("=", 1) for item in shlex.split(service["Environment"]))
        assert env["BLINK_CACHE_DIR"] == f"/var/cache/{service['CacheDirectory']}", name


def test_pod_cache_dir_is_writable():
    """The pod's engine cache (test_engine_cache_dir_is_writable) on a volume of its own."""
    pod = k8s_docs()[0]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == env["BLINK_CACHE_DIR"]]
    assert not mount.get("readOnly")
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert "emptyDir" in volume and volume["emptyDir"].get("medium") != "Memory"


def test_units_run_what_setup_installs():
    """Every unit runs the blink that deploy/setup.sh installs in the checkout's .venv, as the
    user the install notes create, restarts on failure, and stops by a signal Blink drains on
    within a time that covers it."""
    setup = (DEPLOY / "setup.sh").read_text()
    assert '-m venv .venv' in setup and 'blink = "blink.client.cli:main"' in (
        ROOT / "pyproject.toml").read_text()
    for name in ALL_UNITS:
        unit, args = systemd_unit(name)
        service = unit["Service"]
        assert shlex.split(service["ExecStart"])[0] == "/opt/blink/.venv/bin/blink", name
        assert service["User"] == "blink" and service["Restart"] in ("always", "on-failure")
        assert signal.Signals[service.get("KillSignal", "SIGTERM")] in STOP_SIGNALS
        stop_s = float(service["TimeoutStopSec"])
        if args.command == "engine":
            assert stop_s >= ENGINE_STOP_S, name
        else:  # the drain, then the workers' gRPC stop (1 s) and exit
            assert stop_s >= args.shutdown_timeout + 5, name


def test_metrics_ports_as_the_front_ends_serve_them():
    """--metrics-host defaults to --host: the units' and the pod's --host 0.0.0.0 serves the
    metrics on every interface, where Prometheus scrapes a pod's IP; worker i serves its own on
    the metrics port + i, the range the units name."""
    for name in FRONTEND_UNITS:
        unit, args = systemd_unit(name)
        host = effective_metrics_host(args)  # (0.0.0.0: both families where there is IPv6)
        assert host == args.host or (args.host == "0.0.0.0" and host == "::")
        first, last = args.metrics_port, args.metrics_port + args.workers - 1
        assert f"metrics on {first}-{last}" in unit["Unit"]["Description"], name
    deployment, service, _ = k8s_docs()
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    args = parse_blink(container["args"])
    assert args.workers == 1  # (one metrics port: the annotation's)
    host = effective_metrics_host(args)
    assert ipaddress.ip_address(host).is_unspecified  # not loopback: scraped by the pod's IP
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": args.port, "metrics": args.metrics_port}
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == ports


def test_pod_probes_memory_and_ring():
    """Probes on the health service the front end registers; liveness that a model load cannot
    fail; /dev/shm large enough for the ring at the served context, within the memory limit."""
    pod = k8s_docs()[0]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = parse_blink(container["args"])
    for probe in ("readinessProbe", "startupProbe"):
        assert container[probe]["grpc"] == {"port": args.port, "service": SERVICE_NAME}
    # liveness: the process answers TCP from before the engine loads; NOT_SERVING (an engine
    # serve restarts, a drain) must not kill the pod
    assert "grpc" not in container["livenessProbe"] and "tcpSocket" in container["livenessProbe"]
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # a cold 8B load
    ring = RingGeometry(args.slots, MODEL_CONTEXT - 1, MODEL_CONTEXT).total_bytes
    (shm,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == shm["name"]]
    assert volume["emptyDir"]["medium"] == "Memory"
    size = quantity_bytes(volume["emptyDir"]["sizeLimit"])
    limits, requests = container["resources"]["limits"], container["resources"]["requests"]
    assert 2 * ring <= size <= quantity_bytes(limits["memory"])
    assert quantity_bytes(requests["memory"]) <= quantity_bytes(limits["memory"])
    assert limits["nvidia.com/gpu"] == 1 and args.slots >= args.max_num_seqs


def test_envoy_streams_and_retries():
    """HTTP/2 to the replicas with no timeout on streams; retries only where no replica took
    the request or the client has no byte yet: UNAVAILABLE before any token, a connection
    that failed (a pod just gone), a stream HTTP/2 refused (GOAWAY): never reset or 5xx."""
    config = envoy_config()
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"]
    assert hcm["stream_idle_timeout"] == "0s"
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    safe = {"unavailable", "connect-failure", "refused-stream"}
    for route in routes:
        assert route["route"]["timeout"] == "0s"
        assert set(route["route"]["retry_policy"]["retry_on"].split(",")) == safe
    for cluster in config["static_resources"]["clusters"]:
        options = cluster["typed_extension_protocol_options"][
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
        assert "http2_protocol_options" in options["explicit_http_config"]


def test_envoy_circuit_breakers_admit_what_replicas_queue():
    """Envoy's default limits (1,024 streams a cluster, 3 retries at once) refused streams
    (UNAVAILABLE) that the replicas would have run or queued; Blink's own queue and its
    RESOURCE_EXHAUSTED are the admission control."""
    deployment = k8s_docs()[0]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    args = parse_blink(container["args"])
    queued = deployment["spec"]["replicas"] * (args.slots + args.max_queued)
    for cluster in envoy_config()["static_resources"]["clusters"]:
        (limits,) = cluster["circuit_breakers"]["thresholds"]
        assert limits["max_requests"] >= queued and limits["max_pending_requests"] >= queued
        assert limits["max_retries"] > 3, cluster["name"]  # (Envoy's default)


def test_envoy_admin_on_loopback():
    """The admin interface has no authentication and can stop Envoy (/quitquitquit) or
    change its runtime: loopback only."""
    admin = envoy_config()["admin"]["address"]["socket_address"]["address"]
    assert ipaddress.ip_address(admin).is_loopback


def test_engine_units_tell_systemd_they_serve_and_live():
    """The engine units are Type=notify with a watchdog: the engine says READY=1 once it serves
    and WATCHDOG=1 only while its heartbeat moves (blink.ring.lifecycle.SystemdNotify), so
    systemd restarts one whose scheduler hung, where the front end could only say NOT_SERVING.
    Starting may take minutes (a model's load, kernels' compile, GEMM tuning)."""
    for name in ENGINE_UNITS:
        service = systemd_unit(name)[0]["Service"]
        assert service["Type"] == "notify" and service["NotifyAccess"] == "main", name
        assert service["TimeoutStartSec"] in ("infinity", "30min"), name
        # longer than any step's silence: an 8,000-token prompt's prefill is a fraction of it
        assert int(service["WatchdogSec"]) >= 10, name


def test_units_keep_restarting():
    """Restart=always under systemd's default start limit (5 starts in 10 s) still ends in
    `failed` for a unit that fails at once a few times in a row, RestartSec=1 or 2 apart (its
    ring still claimed, its peer not up): the units lift the limit."""
    for name in ALL_UNITS:
        unit, _ = systemd_unit(name)
        assert unit["Service"]["Restart"] == "always", name
        assert unit["Unit"]["StartLimitIntervalSec"] == "0", name
