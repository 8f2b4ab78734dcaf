"""The multi-GPU layouts' compose files (issue 23): each worker on a GPU of its own and told to
use it, copies that agree with what they copy, tensor-parallel ranks that meet, a decode worker
that prefill workers reach, a load balancer in front of any number of API servers, models beside
the built-in one, and the README's image build. test_layouts_k8s.py checks the Kubernetes
layouts, test_layouts_run.py runs them all."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from tests.support.deploy import (
    COMPOSE_FILES,
    COMPOSE_LAYOUTS,
    COMPOSE_SECRETS,
    IMAGE_CURVE_KEYS_DIR,
    README,
    ROOT,
    VERSION,
    flag,
    options,
    readme_command,
    readme_commands,
    resolved_compose,
    resolved_layout,
    run_compose_config,
)

HAPROXY_CONFIG = ROOT / "deploy" / "haproxy" / "haproxy.cfg"
OPERATOR = {"SWITCHYARD_MODEL": "/models/extra/Llama-3.2-1B-Instruct"}
MODELS_MOUNT = "/models/extra"
SAME_AS_THE_WORKER = ("build", "image", "restart", "environment", "read_only", "tmpfs")
SAME_AS_THE_WORKER += ("cap_drop", "security_opt", "volumes", "networks", "ipc", "depends_on")


def workers(services: dict) -> dict[str, list[str]]:
    """The command of each compose service that runs ``python -m worker``."""
    return {
        name: service["command"]
        for name, service in services.items()
        if (service.get("command") or [])[:3] == ["python", "-m", "worker"]
    }


# -- docker-compose ----------------------------------------------------------------------------


def test_no_compose_file_has_the_top_level_name_that_docker_compose_1_refuses():
    """docker-compose 1.29 refuses a top-level ``name:`` (it was checked by hand with 1.29.2,
    which cannot be installed beside this project's PyYAML)."""
    for path in [ROOT / "docker-compose.yml", *(ROOT / "deploy").glob("compose.*.yaml")]:
        assert "name" not in yaml.safe_load(path.read_text()), path


@pytest.mark.parametrize("layout", list(COMPOSE_LAYOUTS))
def test_every_gpu_worker_has_a_gpu_of_its_own_and_is_told_to_use_it(layout):
    services = resolved_layout(layout, OPERATOR)["services"]
    devices = []
    for name, command in workers(services).items():
        assert "--device=cuda" in command, name
        (reservation,) = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert reservation["driver"] == "nvidia" and "count" not in reservation, name
        devices += reservation["device_ids"]
    assert sorted(devices) == [str(index) for index in range(len(workers(services)))]


def cuda_build_args() -> dict[str, str]:
    """The CUDA build arguments of deploy/compose.gpu.yaml."""
    return yaml.safe_load(COMPOSE_FILES[1].read_text())["x-cuda-build"]["build"]["args"]


@pytest.mark.parametrize("layout", list(COMPOSE_LAYOUTS))
def test_the_copies_in_the_gpu_files_agree_with_what_they_copy(layout):
    """YAML anchors do not cross files: compose.gpu.yaml gives its CUDA build arguments to each
    service it builds, and compose.{tp,pd,dp}.yaml copy the base worker (``x-gpu-worker``).
    Resolved, every image is built alike (one tag: one build without them would overwrite the
    CUDA image) and every worker is the base worker's container, but for its command and GPU."""
    services = resolved_layout(layout, OPERATOR)["services"]
    built = {name: service for name, service in services.items() if "build" in service}
    assert set(built) == {"keygen", "scheduler", "api-server", *workers(services)}
    build = {"context": str(ROOT), "dockerfile": "deploy/Dockerfile", "args": cuda_build_args()}
    for name, service in built.items():
        assert service["build"] == build, name
        assert service["image"] == f"switchyard:{VERSION}", name
    assert len(workers(services)) == 2
    for name in workers(services):
        for key in SAME_AS_THE_WORKER:
            assert services[name][key] == services["worker"][key], (name, key)


def test_the_readme_and_the_dockerfile_build_the_cuda_image_as_the_gpu_file_does():
    command = readme_command("docker build", "BASE_IMAGE")
    assert dict(re.findall(r"--build-arg (\w+)=(\S+)", command)) == cuda_build_args()
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    assert dict(re.findall(r"--build-arg (\w+)=(\S+)", dockerfile)) == cuda_build_args()
    builds = [c for c in readme_commands() if c.startswith("docker build ")]
    assert len(builds) == 2  # CUDA and CPU, each tagged as every manifest names it
    for build in builds:
        assert build.startswith(f"docker build -f deploy/Dockerfile -t switchyard:{VERSION} ")
        assert build.endswith(" .")
    assert f"kind load docker-image switchyard:{VERSION}" in readme_commands()


def test_the_base_gpu_file_puts_its_one_worker_on_gpu_0():
    completed = run_compose_config(COMPOSE_SECRETS, *COMPOSE_LAYOUTS["tp"][:2])
    services = json.loads(completed.stdout)["services"]
    (reservation,) = services["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert reservation["device_ids"] == ["0"]


def test_the_tensor_parallel_ranks_meet_at_rank_0s_container():
    services = resolved_layout("tp", OPERATOR)["services"]
    ranks = {name: options(command) for name, command in workers(services).items()}
    assert {name: flags["--rank"] for name, flags in ranks.items()} == {
        "worker": "0",
        "worker-rank1": "1",
    }
    shared = ("--tensor-parallel-size", "--master-addr", "--master-port", "--group", "--model")
    for key in shared:
        assert len({flags[key] for flags in ranks.values()}) == 1, key
    assert ranks["worker"]["--master-addr"] == "worker"
    assert ranks["worker"]["--tensor-parallel-size"] == str(len(ranks))
    assert ranks["worker"]["--model"] == OPERATOR["SWITCHYARD_MODEL"]
    api_server = options(services["api-server"]["command"])
    assert api_server["--model"] == OPERATOR["SWITCHYARD_MODEL"]
    refused = run_compose_config(COMPOSE_SECRETS, *COMPOSE_LAYOUTS["tp"])
    assert refused.returncode != 0
    assert "set SWITCHYARD_MODEL to a model under /models/extra" in refused.stderr


def test_the_decode_worker_binds_its_only_interface_with_curve():
    services = resolved_layout("pd", OPERATOR)["services"]
    roles = {name: options(command) for name, command in workers(services).items()}
    assert {name: flags["--role"] for name, flags in roles.items()} == {
        "worker": "prefill",
        "worker-decode": "decode",
    }
    decode = roles["worker-decode"]
    assert decode["--kv-transfer-addr"] == "tcp://eth0:5557"
    assert "--allow-remote-bind" in decode
    assert decode["--curve-keys-dir"] == IMAGE_CURVE_KEYS_DIR
    assert list(services["worker-decode"]["networks"]) == ["switchyard"]  # so eth0 is on it
    assert "--kv-transfer-addr" not in roles["worker"]


def test_data_parallel_workers_are_hybrid_groups_with_names_of_their_own():
    services = resolved_layout("dp", OPERATOR)["services"]
    for name, command in workers(services).items():
        flags = options(command)
        assert "--role" not in flags and "--group" not in flags, name  # host and pid name it
        assert "--tensor-parallel-size" not in flags, name
    assert len(workers(services)) == 2


def test_the_load_balancer_fronts_every_api_server_replica():
    services = resolved_compose()["services"]
    api_server, balancer = services["api-server"], services["load-balancer"]
    assert "ports" not in api_server  # reached through the load balancer only
    (port,) = balancer["ports"]
    assert (port["host_ip"], port["published"], port["target"]) == ("127.0.0.1", "8000", 8000)
    (config,) = balancer["volumes"]
    assert config["source"] == str(HAPROXY_CONFIG) and config["read_only"]
    assert config["target"] == "/usr/local/etc/haproxy/haproxy.cfg"
    assert balancer["read_only"] is True and balancer["cap_drop"] == ["ALL"]
    networks = resolved_compose()["networks"]
    assert list(balancer["networks"]) == ["frontend"] and not networks["frontend"].get("internal")
    assert "frontend" in api_server["networks"]

    text = HAPROXY_CONFIG.read_text()
    assert re.search(r"^\s+bind :(\d+)$", text, re.MULTILINE)[1] == str(port["target"])
    template = re.search(r"^\s+server-template \S+ (\d+) ([\w-]+):(\d+)$", text, re.MULTILINE)
    assert template[2] == "api-server" and template[3] == flag(api_server["command"], "--port")
    assert int(template[1]) >= api_server["deploy"]["replicas"]
    assert re.search(r"^\s+option httpchk GET /ready$", text, re.MULTILINE)
    # Streamed tokens pass at once, not merged by the kernel (README says so too).
    defaults = re.search(r"^defaults\n((?:[ \t].*\n)+)", text, re.MULTILINE)[1]
    assert re.search(r"^\s+option http-no-delay$", defaults, re.MULTILINE)
    assert "`option http-no-delay`" in README.read_text()
    assert re.search(r"^\s+nameserver \w+ 127\.0\.0\.11:53$", text, re.MULTILINE)  # Docker's
    # A response not streamed may take this long to start: documented beside the README's
    # description of the load balancer.
    (server_timeout,) = re.findall(r"^\s+timeout server (\S+)$", text, re.MULTILINE)
    assert server_timeout == "1h"
    assert f"`timeout server {server_timeout}`" in README.read_text()


def test_models_come_from_a_volume_beside_the_built_in_one():
    services = resolved_compose()["services"]
    for name in ("worker", "api-server"):
        mounts = {volume["target"]: volume for volume in services[name]["volumes"]}
        assert "/models" not in mounts, name
        models = mounts[MODELS_MOUNT]
        assert models["type"] == "bind" and models["read_only"], name
        assert models["source"] == str(ROOT / "models"), name  # SWITCHYARD_MODELS_DIR's default
    assert f"&& mkdir {MODELS_MOUNT}" in (ROOT / "deploy" / "Dockerfile").read_text()


def test_the_compose_images_carry_the_version():
    for name, service in resolved_compose()["services"].items():
        if "build" in service:
            assert service["image"] == f"switchyard:{VERSION}", name
