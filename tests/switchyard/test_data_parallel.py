"""Data parallelism behind one scheduler: ``serve --data-parallel-size N`` starts N hybrid
groups, checked when the config is made; on CUDA each group gets devices of its own
(``switchyard.devices``); each group restarts alone under its name, on its devices; a
standalone worker's default group name is unique among hosts. No GPU: devices are given as
lists. tests/e2e/test_data_parallel_e2e.py serves with two groups."""

from __future__ import annotations

import logging
import socket

import pytest

from interfaces.worker_to_scheduler import WorkerRole
from scheduler.worker_group import MAX_GROUPS
from switchyard import cli, devices
from switchyard.devices import assign_devices, parse_visible_devices, visible_cuda_devices
from switchyard.launcher import Launcher
from switchyard.serve_config import ServeConfig
from worker.settings import WorkerSettings

HYBRID_RANKS = ("hybrid-0-0", "hybrid-0-1", "hybrid-1-0", "hybrid-1-1")


def flag(argv: list[str], name: str, default: str | None = None) -> str:
    """The value of flag ``name`` in ``argv`` (``default`` when it is left out: the role's)."""
    return argv[argv.index(name) + 1] if name in argv or default is None else default


# -- ServeConfig --------------------------------------------------------------------------------


def test_data_parallel_groups_are_hybrid_groups_named_by_index(tmp_path):
    assert ServeConfig(tmp_path, "m").worker_groups == [("hybrid", WorkerRole.HYBRID)]
    config = ServeConfig(
        tmp_path,
        "m",
        data_parallel_size=3,
        worker=WorkerSettings(tensor_parallel_size=2),
        embedding_model_dir=tmp_path,
        embedding_model_name="vectors",
    )
    assert config.worker_groups == [(f"hybrid-{i}", WorkerRole.HYBRID) for i in range(3)]
    assert config.num_worker_processes == 3 * 2 + 1


@pytest.mark.parametrize(
    ("given", "error"),
    [
        ({"data_parallel_size": 0}, "--data-parallel-size must be at least 1, got 0"),
        ({"data_parallel_size": -2}, "--data-parallel-size must be at least 1, got -2"),
        (
            {"data_parallel_size": 2, "prefill_workers": 1, "decode_workers": 1},
            "--data-parallel-size starts hybrid worker groups; disaggregated serving gets its "
            "groups from --prefill-workers and --decode-workers: give one or the other",
        ),
        (
            {"data_parallel_size": MAX_GROUPS + 1},
            f"{MAX_GROUPS + 1} worker groups asked for; the scheduler serves at most {MAX_GROUPS}",
        ),
        (
            {"prefill_workers": MAX_GROUPS, "decode_workers": 1},
            f"{MAX_GROUPS + 1} worker groups asked for; the scheduler serves at most {MAX_GROUPS}",
        ),
        (
            {"data_parallel_size": 2, "worker": WorkerSettings(device="cuda:1")},
            "--device cuda:1 puts all 2 worker groups on one GPU; give --device cuda (or auto): "
            "each group then gets GPUs of its own",
        ),
        (
            {"prefill_workers": 1, "decode_workers": 1, "worker": WorkerSettings(device="cuda:0")},
            "--device cuda:0 puts all 2 worker groups on one GPU; give --device cuda (or auto): "
            "each group then gets GPUs of its own",
        ),
    ],
)
def test_what_cannot_be_served_is_refused(tmp_path, given, error):
    with pytest.raises(ValueError) as raised:
        ServeConfig(tmp_path, "m", **given)
    assert str(raised.value) == error


def test_what_can_be_served_is_taken(tmp_path):
    one_gpu = ServeConfig(tmp_path, "m", worker=WorkerSettings(device="cuda:1"))
    assert one_gpu.worker_groups == [("hybrid", WorkerRole.HYBRID)]
    most = ServeConfig(tmp_path, "m", data_parallel_size=MAX_GROUPS)
    assert len(most.worker_groups) == MAX_GROUPS
    with pytest.raises(ValueError) as raised:
        ServeConfig(None, None, data_parallel_size=2, embedding_model_dir=tmp_path)
    assert str(raised.value) == (
        "--data-parallel-size configure the text generation model; --model none serves none"
    )


def test_serve_says_what_it_refuses_and_exits_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "setproctitle", lambda title: None)
    monkeypatch.setattr(cli, "configure_logging", lambda *args: None)
    monkeypatch.setattr(cli, "_prepare_in_child", lambda model, args: tmp_path)
    given = ["--data-parallel-size", "2", "--prefill-workers", "1", "--decode-workers", "1"]
    for argv, error in (
        (["--data-parallel-size", "0"], "--data-parallel-size must be at least 1, got 0"),
        (given, "--data-parallel-size starts hybrid worker groups"),
    ):
        assert cli.main(["serve", "--model", "tiny", *argv]) == 2
        assert capsys.readouterr().err.startswith(f"switchyard: error: {error}")
    with pytest.raises(SystemExit):
        cli.main(["serve", "--data-parallel-size", "two"])
    assert "argument --data-parallel-size: invalid int value: 'two'" in capsys.readouterr().err


# -- devices ------------------------------------------------------------------------------------


def test_cuda_visible_devices_is_read_as_cuda_reads_it():
    assert parse_visible_devices("0,1,2") == ["0", "1", "2"]
    assert parse_visible_devices(" 3, GPU-8f2a ,MIG-1") == ["3", "GPU-8f2a", "MIG-1"]
    assert parse_visible_devices("2,,3") == ["2"]
    assert parse_visible_devices("1,-1,2") == ["1"]
    assert parse_visible_devices("") == parse_visible_devices("-1") == []


def test_each_group_takes_the_next_slice_and_the_embedding_worker_a_spare_device():
    groups = ["hybrid-0", "hybrid-1"]
    gpus = ["0", "1", "2", "3", "4", "5"]
    assert assign_devices(groups, 2, None, gpus) == {"hybrid-0": "0,1", "hybrid-1": "2,3"}
    assert assign_devices(groups, 2, "embedding", gpus) == {
        "hybrid-0": "0,1",
        "hybrid-1": "2,3",
        "embedding": "4",
    }
    pd = ["prefill-0", "decode-0", "decode-1"]
    assert assign_devices(pd, 1, None, ["4", "6", "7"]) == {
        "prefill-0": "4",
        "decode-0": "6",
        "decode-1": "7",
    }
    assert assign_devices([], 1, "embedding", ["GPU-a", "GPU-b"]) == {"embedding": "GPU-a"}


def test_with_no_device_to_spare_the_embedding_worker_shares_the_last_groups_last():
    assigned = assign_devices(["hybrid-0", "hybrid-1"], 2, "embedding", ["0", "1", "2", "3"])
    assert assigned == {"hybrid-0": "0,1", "hybrid-1": "2,3", "embedding": "3"}


def test_too_few_devices_for_the_groups_is_refused():
    with pytest.raises(ValueError) as raised:
        assign_devices(["hybrid-0", "hybrid-1"], 2, None, ["0", "1", "2"])
    assert str(raised.value) == (
        "2 worker group(s) of 2 rank(s) need 4 GPU(s), one per rank; 3 visible (0,1,2). Lower "
        "--data-parallel-size, --prefill-workers/--decode-workers or --tensor-parallel-size, or "
        "serve on the CPU (--device cpu)"
    )


def no_probe() -> int:
    raise AssertionError("torch was asked for the devices")


@pytest.mark.parametrize("device", ["cpu", "cuda:0", "cuda:3"])
def test_the_cpu_and_one_named_gpu_assign_nothing(device, monkeypatch):
    monkeypatch.setattr(devices, "cuda_device_count", no_probe)
    monkeypatch.setattr(devices, "_has_gpu_driver", lambda: True)
    assert visible_cuda_devices(device) is None


def test_auto_without_a_gpu_driver_or_with_none_visible_is_the_cpu_unasked(monkeypatch):
    monkeypatch.setattr(devices, "cuda_device_count", no_probe)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(devices, "_has_gpu_driver", lambda: False)
    assert visible_cuda_devices("auto") is None
    monkeypatch.setattr(devices, "_has_gpu_driver", lambda: True)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_cuda_devices("auto") is None


@pytest.mark.parametrize(
    ("variable", "count", "device", "visible"),
    [
        (None, 4, "auto", ["0", "1", "2", "3"]),
        (None, 2, "cuda", ["0", "1"]),
        ("5,7,GPU-x", 3, "cuda", ["5", "7", "GPU-x"]),
        ("5,7,9", 2, "auto", ["5", "7"]),  # CUDA stopped at a device it does not have
        (None, 0, "auto", None),  # a driver, but no CUDA for torch: the CPU
    ],
)
def test_the_visible_devices_are_the_launchers_own(monkeypatch, variable, count, device, visible):
    monkeypatch.setattr(devices, "cuda_device_count", lambda: count)
    monkeypatch.setattr(devices, "_has_gpu_driver", lambda: True)
    if variable is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", variable)
    assert visible_cuda_devices(device) == visible


def test_cuda_with_no_device_is_refused(monkeypatch):
    monkeypatch.setattr(devices, "cuda_device_count", lambda: 0)
    with pytest.raises(ValueError) as raised:
        visible_cuda_devices("cuda")
    assert str(raised.value) == "--device cuda: no CUDA device is available"


def test_the_device_count_comes_from_a_child_and_is_checked(monkeypatch, caplog):
    """The child's answer is believed only as a count up to ``MAX_DEVICES`` (stand-in
    children, without torch)."""
    monkeypatch.setattr(devices, "_PROBE", "print('loading'); print(4)")
    assert devices.cuda_device_count() == 4
    with caplog.at_level(logging.WARNING, logger="switchyard"):
        for probe in (f"print({devices.MAX_DEVICES + 1})", "print(-1)", "raise SystemExit(3)"):
            monkeypatch.setattr(devices, "_PROBE", probe)
            assert devices.cuda_device_count() == 0
    assert caplog.messages == [
        "counting CUDA devices failed (exit 0, '1025'); taking none",
        "counting CUDA devices failed (exit 0, '-1'); taking none",
        "counting CUDA devices failed (exit 3, ''); taking none",
    ]


# -- the launcher -------------------------------------------------------------------------------


def test_each_groups_ranks_get_its_devices_and_a_rendezvous_of_their_own(make_launcher, tmp_path):
    launcher = make_launcher(
        gpus=["0", "1", "2", "3", "4"],
        data_parallel_size=2,
        worker=WorkerSettings(tensor_parallel_size=2),
        embedding_model_dir=tmp_path,
        embedding_model_name="vectors",
    )
    environments = {
        name: launcher.environments[name] for name in (*HYBRID_RANKS, "embedding-worker")
    }
    assert environments == {
        "hybrid-0-0": {"CUDA_VISIBLE_DEVICES": "0,1"},
        "hybrid-0-1": {"CUDA_VISIBLE_DEVICES": "0,1"},
        "hybrid-1-0": {"CUDA_VISIBLE_DEVICES": "2,3"},
        "hybrid-1-1": {"CUDA_VISIBLE_DEVICES": "2,3"},
        "embedding-worker": {"CUDA_VISIBLE_DEVICES": "4"},
    }
    assert launcher.environments["scheduler"] == {}
    argv = launcher._worker_group_argv("ipc://backend", "hybrid-1")
    assert [flag(argv[name], "--group") for name in argv] == ["hybrid-1", "hybrid-1"]
    assert [flag(argv[name], "--rank", "0") for name in argv] == ["0", "1"]
    ports = {flag(argv[name], "--master-port") for name in argv}
    assert ports == {str(launcher._master_ports["hybrid-1"])}
    assert launcher._master_ports["hybrid-0"] != launcher._master_ports["hybrid-1"]


def test_a_dead_group_restarts_alone_on_its_devices_while_the_other_serves(make_launcher):
    launcher = make_launcher(
        gpus=["0", "1", "2", "3"],
        data_parallel_size=2,
        worker=WorkerSettings(tensor_parallel_size=2),
    )
    other = {name: launcher.children[name] for name in HYBRID_RANKS[:2]}
    launcher.children["hybrid-1-1"].returncode = -9
    assert launcher._failure(1.0) is None
    assert [name for name, _, _ in launcher.starts] == ["hybrid-1-0", "hybrid-1-1"]
    assert launcher.environments["hybrid-1-0"] == {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert all(launcher.children[name] is other[name] for name in other)
    assert all(process.signals == [] for process in other.values())
    assert launcher._master_ports["hybrid-0"] != launcher._master_ports["hybrid-1"]
    assert launcher.worker_groups.budget.used(1.0) == 1


def test_on_the_cpu_the_groups_share_the_cores_and_no_devices_are_set(make_launcher, monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    launcher = make_launcher(data_parallel_size=2)
    assert launcher.group_devices == {}
    argv = launcher.engine_argv("ipc://backend")
    assert [flag(argv[name], "--num-threads") for name in ("hybrid-0", "hybrid-1")] == ["4", "4"]
    assert launcher.environments["hybrid-0"] == launcher.environments["hybrid-1"] == {}
    launcher.children["hybrid-0"].returncode = -9
    assert launcher._failure(0.0) is None
    assert [name for name, _, _ in launcher.starts] == ["hybrid-0"]
    assert flag(launcher.starts[0][1], "--group") == "hybrid-0"


def test_too_few_gpus_stop_serve_before_any_process_starts(tmp_path, monkeypatch):
    monkeypatch.setattr("switchyard.launcher.visible_cuda_devices", lambda device: ["0", "1"])
    launcher = Launcher(ServeConfig(tmp_path, "m", data_parallel_size=3))
    spawned = []
    monkeypatch.setattr(launcher, "_spawn", lambda name, *args, **variables: spawned.append(name))
    try:
        with pytest.raises(ValueError, match=r"^3 worker group\(s\) of 1 rank\(s\) need 3 GPU"):
            launcher.start_engine()
    finally:
        launcher.shutdown()
    assert spawned == []


# -- standalone workers -------------------------------------------------------------------------


def default_group(monkeypatch, host: str, pid: int, **settings) -> str:
    """``python -m worker``'s group name without ``--group`` on host ``host`` as process
    ``pid``."""
    from worker import __main__ as worker_main  # torch: only in the test that needs it

    monkeypatch.setattr(socket, "gethostname", lambda: host)
    monkeypatch.setattr("os.getpid", lambda: pid)
    return worker_main._default_group(WorkerSettings(**settings))


def test_scaled_worker_containers_name_their_groups_apart_without_configuration(monkeypatch):
    """``docker compose up --scale worker=3``: the same command in containers whose host names
    differ (and whose worker may have the same pid). The ranks of one tensor-parallel group
    agree on the name; ranks meeting at another host's address take its address."""
    one_rank = {default_group(monkeypatch, f"c{i}", 7) for i in range(3)}
    assert one_rank == {"hybrid@c0:7", "hybrid@c1:7", "hybrid@c2:7"}
    assert default_group(monkeypatch, "c0", 8) == "hybrid@c0:8"
    for address in ("127.0.0.1", "localhost", "::1", "127.0.1.1"):
        names = {
            default_group(monkeypatch, f"c{i}", 7, tensor_parallel_size=2, master_addr=address)
            for i in range(3)
        }
        assert names == {"hybrid@c0:29500", "hybrid@c1:29500", "hybrid@c2:29500"}, address
    ranks = [
        default_group(
            monkeypatch,
            host,
            pid,
            tensor_parallel_size=2,
            rank=rank,
            master_addr="10.0.0.2",
            role=WorkerRole.DECODE,
        )
        for rank, (host, pid) in enumerate((("node-a", 7), ("node-b", 9)))
    ]
    assert ranks == ["decode@10.0.0.2:29500"] * 2
