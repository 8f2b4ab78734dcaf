"""The Kubernetes layouts' manifests (issue 23): valid for Kubernetes and the LeaderWorkerSet
CRD, every role reaching the one scheduler with CURVE, each worker on the GPU it holds, rollouts
that need no spare GPU, versioned images never pulled from a public registry, and the README's
edits (another model from the opt-in claim, CPU nodes) leaving valid manifests. The compose
files: test_layouts_files.py; test_layouts_run.py runs both."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import pytest

from tests.support.deploy import (
    IMAGE_CURVE_KEYS_DIR,
    K8S_DIR,
    K8S_LAYOUTS,
    MODELS_CLAIM,
    VERSION,
    flag,
    k8s_copy,
    k8s_documents,
    kubernetes_validate,
    options,
    pod_template,
    readme_command,
    readme_commands,
    split_layout,
)

LWS_SCHEMA = Path(__file__).with_name("schemas") / "leaderworkerset-v1.json"
MODELS_MOUNT = "/models/extra"


def layout_files(k8s_dir: Path = K8S_DIR) -> list[Path]:
    """Every manifest file of every layout in ``k8s_dir`` (deploy/k8s or a copy), but the
    opt-in claim: the one-pod layout's, the split layout's and its worker files."""
    paths = [*sorted(k8s_dir.glob("*.yaml")), *sorted((k8s_dir / "split").glob("*.yaml"))]
    workers = (path for files in K8S_LAYOUTS.values() for path in files)
    return paths + [k8s_dir / path.relative_to(K8S_DIR) for path in workers]


def every_k8s_document(k8s_dir: Path = K8S_DIR) -> list[dict]:
    return k8s_documents(*layout_files(k8s_dir))


def every_k8s_pod(k8s_dir: Path = K8S_DIR) -> list[tuple[str, dict]]:
    """(name, pod spec) of every Deployment and LeaderWorkerSet."""
    return [
        (name(document), pod_template(document)["spec"])
        for document in every_k8s_document(k8s_dir)
        if document["kind"] in ("Deployment", "LeaderWorkerSet")
    ]


def every_k8s_container(k8s_dir: Path = K8S_DIR) -> list[dict]:
    return [
        container
        for _, pod in every_k8s_pod(k8s_dir)
        for container in pod.get("initContainers", []) + pod["containers"]
    ]


def without_crds(paths: list[Path]) -> list[Path]:
    """``paths`` but servicemonitor.yaml, whose CRD kubernetes-validate does not know (its
    schema test: test_deploy.py)."""
    return [path for path in paths if path.name != "servicemonitor.yaml"]


def test_the_split_manifests_pass_kubernetes_validate(tmp_path):
    """(deployment.yaml's: test_deploy.py.)"""
    split = sorted((K8S_DIR / "split").glob("*.yaml"))
    workers = [path for files in K8S_LAYOUTS.values() for path in files]
    kubernetes_validate([*split, *workers], tmp_path)


def strict(schema: object) -> object:
    """``schema`` refusing fields it does not name, as the API server's strict field
    validation does (except where the CRD keeps unknown fields)."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    result = {key: strict(value) for key, value in schema.items()}
    if "properties" in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
        result.setdefault("additionalProperties", False)
    return result


def test_the_leader_worker_set_matches_its_crd():
    schema = strict(json.loads(LWS_SCHEMA.read_text()))
    (lws,) = k8s_documents(*K8S_LAYOUTS["split-lws"])
    jsonschema.validate(lws, schema)
    broken = copy.deepcopy(lws)
    broken["spec"]["leaderWorkerTemplate"]["sizes"] = 2
    with pytest.raises(jsonschema.ValidationError):  # the check refuses unknown fields
        jsonschema.validate(broken, schema)


def test_the_leader_worker_set_is_one_tensor_parallel_group_of_two_pods():
    (lws,) = k8s_documents(*K8S_LAYOUTS["split-lws"])
    template = lws["spec"]["leaderWorkerTemplate"]
    assert template["size"] == 2 and "leaderTemplate" not in template  # both run one template
    assert template["restartPolicy"] == "RecreateGroupOnPodRestart"
    (container,) = pod_template(lws)["spec"]["containers"]
    flags = options(container["command"])
    assert flags["--tensor-parallel-size"] == "$(LWS_GROUP_SIZE)"
    assert flags["--rank"] == "$(LWS_WORKER_INDEX)"
    assert flags["--master-addr"] == "$(LWS_LEADER_ADDRESS)"
    assert {"name": "rendezvous", "containerPort": int(flags["--master-port"])} in container[
        "ports"
    ]
    assert lws["spec"]["rolloutStrategy"]["rollingUpdateConfiguration"]["maxSurge"] == 0


def one(documents: list[dict], kind: str, name: str) -> dict:
    (document,) = [d for d in documents if (d["kind"], d["metadata"]["name"]) == (kind, name)]
    return document


@pytest.mark.parametrize("layout", list(K8S_LAYOUTS))
def test_the_split_roles_reach_the_scheduler_service_with_curve(layout):
    documents = split_layout(layout)
    service = one(documents, "Service", "switchyard-scheduler")
    ports = {port["name"]: port["port"] for port in service["spec"]["ports"]}
    scheduler = one(documents, "Deployment", "switchyard-scheduler")
    assert scheduler["spec"]["replicas"] == 1
    assert scheduler["spec"]["strategy"] == {"type": "Recreate"}  # never two schedulers
    (container,) = pod_template(scheduler)["spec"]["containers"]
    assert flag(container["command"], "--frontend-addr") == f"tcp://0.0.0.0:{ports['frontend']}"
    assert flag(container["command"], "--backend-addr") == f"tcp://0.0.0.0:{ports['backend']}"
    assert "--allow-remote-bind" in container["command"]
    # Ready once its sockets are bound (the Service then routes to it), restarted without them.
    assert {"name": "backend", "containerPort": ports["backend"]} in container["ports"]
    readiness, liveness = container["readinessProbe"], container["livenessProbe"]
    assert readiness["tcpSocket"] == liveness["tcpSocket"] == {"port": "backend"}
    assert readiness["periodSeconds"] == 5 and liveness["periodSeconds"] == 10
    assert liveness["periodSeconds"] * liveness["failureThreshold"] == 30
    addresses = {"worker": "backend", "api_server": "frontend"}
    for document in documents:
        if document["kind"] not in ("Deployment", "LeaderWorkerSet"):
            continue
        pod = pod_template(document)
        (keys,) = [v for v in pod["spec"]["volumes"] if v["name"] == "curve-keys"]
        assert keys["secret"]["secretName"] == "switchyard-curve-keys"
        for container in pod["spec"]["containers"]:
            command = container["command"]
            assert flag(command, "--curve-keys-dir") == IMAGE_CURVE_KEYS_DIR
            if command[2] in addresses:
                port = ports[addresses[command[2]]]
                assert flag(command, "--scheduler-addr") == f"tcp://switchyard-scheduler:{port}"
            if command[2] == "worker":  # the NetworkPolicy admits worker pods by this label
                assert pod["metadata"]["labels"]["app.kubernetes.io/component"] == "worker"
    policy = one(documents, "NetworkPolicy", "switchyard-scheduler")["spec"]
    selector = policy["podSelector"]["matchLabels"]
    assert selector.items() <= pod_template(scheduler)["metadata"]["labels"].items()
    hpa = one(documents, "HorizontalPodAutoscaler", "switchyard-api-server")["spec"]
    assert hpa["scaleTargetRef"]["name"] == "switchyard-api-server"


def test_the_decode_pods_tell_the_prefill_pods_their_own_address():
    documents = split_layout("split-pd")
    (decode,) = pod_template(one(documents, "Deployment", "switchyard-decode"))["spec"][
        "containers"
    ]
    assert flag(decode["command"], "--kv-transfer-addr") == "tcp://$(POD_IP):5557"
    assert "--allow-remote-bind" in decode["command"]
    (pod_ip,) = decode["env"]
    assert pod_ip == {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    assert decode["ports"] == [{"name": "kv-transfer", "containerPort": 5557}]


def test_k8s_gpu_workers_use_their_one_gpu_and_roll_out_without_a_spare_one():
    for document in every_k8s_document():
        if document["kind"] not in ("Deployment", "LeaderWorkerSet"):
            continue
        pod = pod_template(document)["spec"]
        containers = pod.get("initContainers", []) + pod["containers"]
        gpu_workers = [c for c in containers if c["command"][2] == "worker"]
        for container in gpu_workers:
            assert "--device=cuda" in container["command"], name(document)
            assert container["resources"]["limits"]["nvidia.com/gpu"] == 1, name(document)
            assert container["resources"]["requests"]["nvidia.com/gpu"] == 1, name(document)
        if gpu_workers and document["kind"] == "Deployment":
            strategy = document["spec"]["strategy"]
            assert strategy["rollingUpdate"] == {"maxUnavailable": 1, "maxSurge": 0}, name(document)


def models_volumes(k8s_dir: Path = K8S_DIR) -> dict[str, dict]:
    """The volume mounted read-only at /models/extra in each pod (but the split scheduler's,
    which reads no model), by the pod's name (its Deployment's, or its LeaderWorkerSet's)."""
    found = {}
    for pod_name, pod in every_k8s_pod(k8s_dir):
        volumes = {volume["name"]: volume for volume in pod["volumes"]}
        for container in pod.get("initContainers", []) + pod["containers"]:
            mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
            assert "/models" not in mounts, pod_name  # it would hide the built-in model
            if container["command"][2] == "scheduler":
                assert MODELS_MOUNT not in mounts, pod_name
                continue
            assert mounts[MODELS_MOUNT]["readOnly"] is True, pod_name
            found[pod_name] = volumes[mounts[MODELS_MOUNT]["name"]]
    return found


def test_k8s_models_mount_an_empty_directory_until_the_readme_swaps_the_claim_in(tmp_path):
    """By default no layout needs storage (``kubectl apply -f deploy/k8s/`` on kind schedules);
    the README's sed puts the opt-in claim in every pod's place, which stays valid."""
    (claim,) = k8s_documents(MODELS_CLAIM)
    assert claim["kind"] == "PersistentVolumeClaim"
    assert "PersistentVolumeClaim" not in {d["kind"] for d in every_k8s_document()}
    pods = {"switchyard", "switchyard-api-server", "switchyard-worker", "switchyard-prefill"}
    pods |= {"switchyard-decode", "switchyard-tensor-parallel"}
    assert models_volumes() == {pod: {"name": "models", "emptyDir": {}} for pod in pods}

    swap = readme_command("sed -i", "with-models")
    assert readme_command("kubectl apply", "models/pvc.yaml") == (
        f"kubectl apply -f {MODELS_CLAIM.relative_to(K8S_DIR.parents[1])}"
    )
    models = k8s_copy(tmp_path, swap)
    source = {"claimName": name(claim), "readOnly": True}
    volume = {"name": "models", "persistentVolumeClaim": source}
    assert models_volumes(models) == {pod: volume for pod in pods}
    assert every_k8s_container(models) == every_k8s_container()  # nothing else changed
    kubernetes_validate(
        [*without_crds(layout_files(models)), models / "models" / "pvc.yaml"], tmp_path
    )


def test_the_readme_sed_makes_every_worker_a_cpu_one(tmp_path):
    cpu = k8s_copy(tmp_path, readme_command("sed -i", "--device=cpu"))
    workers = [c for c in every_k8s_container() if c["command"][2] == "worker"]
    cpu_workers = [c for c in every_k8s_container(cpu) if c["command"][2] == "worker"]
    assert len(cpu_workers) == len(workers) == 5  # one pod, hybrid, prefill, decode, LWS
    for before, after in zip(workers, cpu_workers, strict=True):
        assert after["command"] == [
            "--device=cpu" if arg == "--device=cuda" else arg for arg in before["command"]
        ]
        for kind in ("requests", "limits"):
            expected = {k: v for k, v in before["resources"][kind].items() if k != "nvidia.com/gpu"}
            assert after["resources"][kind] == expected
    kubernetes_validate(without_crds(layout_files(cpu)), tmp_path)


def test_the_readme_applies_each_split_layout_with_its_worker_file():
    commands = [
        c for c in readme_commands() if c.startswith("kubectl apply -f deploy/k8s/configmap")
    ]
    shared = "kubectl apply -f deploy/k8s/configmap.yaml -f deploy/k8s/split/"
    root = K8S_DIR.parents[1]
    workers = [path.relative_to(root) for files in K8S_LAYOUTS.values() for path in files]
    expected = [f"{shared} -f {path}" for path in workers]
    assert commands == expected


def name(document: dict) -> str:
    return document["metadata"]["name"]


def test_split_pods_run_unprivileged_read_only_and_without_a_token():
    for document in every_k8s_document():
        if document["kind"] not in ("Deployment", "LeaderWorkerSet"):
            continue
        pod = pod_template(document)["spec"]
        assert pod["automountServiceAccountToken"] is False, name(document)
        assert pod["enableServiceLinks"] is False, name(document)
        context = pod["securityContext"]
        assert (context["runAsNonRoot"], context["runAsUser"]) == (True, 10001), name(document)
        volumes = {volume["name"]: volume for volume in pod["volumes"]}
        for container in pod.get("initContainers", []) + pod["containers"]:
            security = container["securityContext"]
            assert security["readOnlyRootFilesystem"] is True, name(document)
            assert security["allowPrivilegeEscalation"] is False, name(document)
            assert security["capabilities"] == {"drop": ["ALL"]}, name(document)
            (tmp,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/tmp"]
            assert "emptyDir" in volumes[tmp["name"]], name(document)


def test_the_images_carry_the_version_and_are_never_pulled_from_a_registry():
    for container in every_k8s_container():
        assert container["image"] == f"switchyard:{VERSION}", container["name"]
        assert container["imagePullPolicy"] == "IfNotPresent", container["name"]
