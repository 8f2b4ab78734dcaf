"""What the deployment files lock down (issue 20, item 11): no internal socket reachable from
another host or container without CURVE, no API without a key, no Grafana with its default
password, the Kubernetes pods unprivileged, read-only, without a service-account token and
behind a NetworkPolicy, and an image whose default command needs an API key. The slow test in
tests/deploy/test_deploy.py runs the roles with these very files, keys and key."""

from __future__ import annotations

import json
import os
import re
import subprocess

import yaml

from tests.support.deploy import (
    COMPOSE_SECRETS,
    IMAGE_CURVE_KEYS_DIR,
    K8S_DIR,
    ROOT,
    flag,
    is_role,
    k8s,
    pod_containers,
    resolved_compose,
    run_compose_config,
)

DOCKERFILE = ROOT / "deploy" / "Dockerfile"
SCHEDULER_PORTS = (5555, 5556)


BIND_FLAGS = ("--frontend-addr", "--backend-addr", "--kv-transfer-addr")


def binds_other_hosts(command: list[str]) -> bool:
    """Whether a role's command binds (or may bind) an address other than loopback or ipc://."""
    binds = [arg.split("=", 1)[1] for arg in command if arg.startswith(BIND_FLAGS)]
    local = [address.startswith(("ipc://", "tcp://127.0.0.1:")) for address in binds]
    return "--allow-remote-bind" in command or not all(local)


# -- docker-compose ----------------------------------------------------------------------------


def test_compose_refuses_to_start_without_the_operators_api_key_and_grafana_password():
    for missing in COMPOSE_SECRETS:
        given = {name: value for name, value in COMPOSE_SECRETS.items() if name != missing}
        for environment in (given, {**given, missing: ""}):
            completed = run_compose_config(environment)
            assert completed.returncode != 0
            assert f"required variable {missing} is missing a value" in completed.stderr
    services = resolved_compose()["services"]
    assert services["api-server"]["environment"]["SWITCHYARD_API_KEY"] == "test-api-key"
    grafana = services["grafana"]["environment"]
    assert grafana["GF_SECURITY_ADMIN_PASSWORD"] == "test-password"
    assert grafana["GF_USERS_ALLOW_SIGN_UP"] == grafana["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    for name, service in services.items():  # only the API servers see the key
        has_key = "SWITCHYARD_API_KEY" in (service.get("environment") or {})
        assert has_key == (name == "api-server"), name


def test_compose_roles_talk_only_with_curve_keys_from_the_keygen_volume():
    services = resolved_compose()["services"]
    roles = {name: service for name, service in services.items() if is_role(service)}
    assert binds_other_hosts(roles["scheduler"]["command"])  # so CURVE, for every role
    for name, service in roles.items():
        assert flag(service["command"], "--curve-keys-dir") == IMAGE_CURVE_KEYS_DIR, name
        (keys,) = [v for v in service["volumes"] if v["target"] == IMAGE_CURVE_KEYS_DIR]
        assert (keys["type"], keys["source"], keys["read_only"]) == ("volume", "curve-keys", True)
    keygen = services["keygen"]
    assert keygen["command"][-1].endswith(f"switchyard keygen --output {IMAGE_CURVE_KEYS_DIR}")
    assert keygen["volumes"] == [
        {"type": "volume", "source": "curve-keys", "target": IMAGE_CURVE_KEYS_DIR}
    ]
    assert keygen["network_mode"] == "none" and keygen["restart"] == "no"
    condition = roles["scheduler"]["depends_on"]["keygen"]["condition"]
    assert condition == "service_completed_successfully"
    for name in ("worker", "api-server"):  # after the scheduler, so after keygen
        assert "scheduler" in roles[name]["depends_on"], name


def test_compose_keeps_grafana_and_prometheus_off_the_internal_network():
    config = resolved_compose()
    services = config["services"]
    networks = {name: set(s.get("networks") or {}) for name, s in services.items()}
    internal = networks["scheduler"]
    assert internal == networks["worker"] == {"switchyard"}
    assert config["networks"]["switchyard"]["internal"] is True  # no route out
    assert internal < networks["api-server"]
    for name in ("prometheus", "grafana"):
        assert networks[name] and not networks[name] & internal, name
        assert networks[name] <= networks["api-server"], name  # scrapes, and nothing else
    for name, service in services.items():  # published on the host's loopback only
        for port in service.get("ports", []):
            assert port["host_ip"] == "127.0.0.1", name


def test_compose_roles_run_read_only_without_capabilities():
    for name, service in resolved_compose()["services"].items():
        if "build" not in service:
            continue
        assert service["read_only"] is True, name
        assert service["cap_drop"] == ["ALL"], name
        assert "no-new-privileges:true" in service["security_opt"], name
        assert service["tmpfs"] == ["/tmp"], name


# -- Kubernetes --------------------------------------------------------------------------------


def test_k8s_ships_no_secret_and_the_api_server_requires_its_key():
    kinds = [
        document["kind"]
        for path in K8S_DIR.glob("*.yaml")
        for document in yaml.safe_load_all(path.read_text())
        if document
    ]
    assert "Secret" not in kinds
    containers = pod_containers()
    (variable,) = containers["api-server"]["env"]
    assert variable["name"] == "SWITCHYARD_API_KEY"
    reference = variable["valueFrom"]["secretKeyRef"]
    assert reference == {"name": "switchyard-api-key", "key": "api-key"}  # not optional
    for name in ("scheduler", "worker"):
        assert "env" not in containers[name], name
    assert "SWITCHYARD_API_KEY" not in k8s("ConfigMap")["data"]
    assert "kubectl create secret generic switchyard-api-key" in deployment_text()


def test_k8s_containers_use_the_curve_keys_secret_read_only():
    pod = k8s("Deployment")["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "curve-keys"]
    assert volume["secret"]["secretName"] == "switchyard-curve-keys"
    assert "optional" not in volume["secret"]
    assert volume["secret"]["defaultMode"] == 0o440  # group-readable: fsGroup, not the world
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"]
    for name, container in pod_containers().items():
        assert flag(container["command"], "--curve-keys-dir") == IMAGE_CURVE_KEYS_DIR, name
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == "curve-keys"]
        assert mount == {"name": "curve-keys", "mountPath": IMAGE_CURVE_KEYS_DIR, "readOnly": True}
    assert "kubectl create secret generic switchyard-curve-keys" in deployment_text()


def test_k8s_pods_run_unprivileged_read_only_and_without_a_token():
    pod = k8s("Deployment")["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert pod["enableServiceLinks"] is False  # no SWITCHYARD_PORT etc. from the Service
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert (pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsGroup"]) == (
        10001,
        10001,
    )
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    writable = {"/tmp", "/dev/shm"}
    for name, container in pod_containers().items():
        context = container["securityContext"]
        assert context["readOnlyRootFilesystem"] is True, name
        assert context["allowPrivilegeEscalation"] is False, name
        assert context["capabilities"] == {"drop": ["ALL"]}, name
        mounts = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
        for path in writable | ({"/var/cache/switchyard"} if name == "worker" else set()):
            assert "emptyDir" in mounts[path], (name, path)
        tmp = [m["name"] for m in container["volumeMounts"] if m["mountPath"] == "/tmp"]
        assert tmp == [f"{name}-tmp"], name  # a /tmp of its own


def test_the_network_policy_admits_only_the_api_port_to_switchyard_pods():
    policy = k8s("NetworkPolicy")["spec"]
    pod = k8s("Deployment")["spec"]["template"]
    assert policy["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert policy["policyTypes"] == ["Ingress", "Egress"]
    assert policy["egress"] == []  # the pods open no connection out
    (rule,) = policy["ingress"]
    assert "from" not in rule  # clients and Prometheus: from anywhere
    assert rule["ports"] == [{"protocol": "TCP", "port": "http"}]
    containers = pod_containers()
    (http,) = containers["api-server"]["ports"]
    assert (http["name"], http["containerPort"]) == ("http", 8000)
    assert flag(containers["api-server"]["command"], "--port") == "8000"
    # The scheduler's ports: bound on the pod's loopback, which only its own containers share.
    scheduler = containers["scheduler"]["command"]
    for address, port in zip(("--frontend-addr", "--backend-addr"), SCHEDULER_PORTS, strict=True):
        assert flag(scheduler, address) == f"tcp://127.0.0.1:{port}"
    assert not binds_other_hosts(scheduler)
    for name in ("scheduler", "worker"):
        assert "ports" not in containers[name], name


def deployment_text() -> str:
    return (K8S_DIR / "deployment.yaml").read_text()


# -- the image ---------------------------------------------------------------------------------


def dockerfile_instruction(name: str) -> str:
    (value,) = re.findall(rf"^{name} (.+)$", DOCKERFILE.read_text(), re.MULTILINE)
    return value


def test_the_image_runs_as_the_pods_non_root_user():
    user, group = dockerfile_instruction("USER").split(":")
    context = k8s("Deployment")["spec"]["template"]["spec"]["securityContext"]
    assert (int(user), int(group)) == (context["runAsUser"], context["runAsGroup"]) != (0, 0)


def test_the_images_command_refuses_to_serve_on_all_interfaces_without_an_api_key(tmp_path):
    """Run as the image runs it, with a stand-in ``switchyard`` on PATH that prints what it
    was started with: no key, no start; a key, and it serves with that key in its environment."""
    command = json.loads(dockerfile_instruction("CMD"))
    assert command[:2] == ["sh", "-c"]
    assert "switchyard serve --host 0.0.0.0 --port 8000" in command[2]
    stand_in = tmp_path / "switchyard"
    stand_in.write_text('#!/bin/sh\necho "key=$SWITCHYARD_API_KEY args=$*"\n')
    stand_in.chmod(0o755)
    environment = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHYARD_")}
    environment["PATH"] = f"{tmp_path}:{environment['PATH']}"
    for key in (None, ""):
        given = environment if key is None else {**environment, "SWITCHYARD_API_KEY": key}
        refused = subprocess.run(command, env=given, capture_output=True, text=True, timeout=10)
        assert refused.returncode != 0 and refused.stdout == ""
        assert "set SWITCHYARD_API_KEY" in refused.stderr
    started = subprocess.run(
        command,
        env={**environment, "SWITCHYARD_API_KEY": "k3y"},
        capture_output=True,
        text=True,
        timeout=10,
    )
    assert started.returncode == 0, started.stderr
    assert started.stdout.startswith("key=k3y args=serve --host 0.0.0.0 --port 8000 ")


def test_nothing_secret_is_committed_or_sent_to_docker_builds():
    ignored = (ROOT / ".gitignore").read_text().splitlines()
    assert ".env" in ignored
    assert ".env" in (ROOT / ".dockerignore").read_text().splitlines()
