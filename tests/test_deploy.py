"""deploy/: the Kubernetes manifests against the Kubernetes API schemas (kubernetes-validate),
the Envoy configuration against Envoy's API (envoy-data-plane: unknown fields, enum values and
typed configs are refused), and every Blink command line in them (systemd units, container
args) parsed by Blink's own CLI, so a renamed or mistyped flag fails here."""
from __future__ import annotations

import configparser
import importlib
import shlex
from pathlib import Path

import pytest

from blink.client.cli import build_parser
from blink.client.sdk import SESSION_HEADER

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
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
                                                   "service": "blink.v1.Blink"}
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
    assert cluster["health_checks"][0]["grpc_health_check"]["service_name"] == "blink.v1.Blink"
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
