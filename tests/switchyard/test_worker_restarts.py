"""The launcher's restart policy for worker groups (docs/reliability.md): which processes are
signalled and started again, when, and when the unit stops instead, with stand-in processes and
a clock the test moves (``conftest.make_launcher``). tests/e2e/test_migration_e2e.py shows the
same with real processes."""

from __future__ import annotations

import json
import logging
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from interfaces.scheduler_to_api import MAX_GROUPS_AWAY
from scheduler.config import SchedulerConfig
from switchyard.groups_away import (
    MAX_BODY_BYTES,
    AwayEntry,
    AwayReport,
    HealthPoller,
    parse_groups_away,
)
from switchyard.launcher import Launcher
from switchyard.serve_config import ServeConfig
from switchyard.worker_restarts import AWAY_MARGIN_S, GROUP_STOP_TIMEOUT_S, WorkerRestartBudget
from worker.settings import WorkerSettings

TP_RANKS = ("worker-0", "worker-1", "worker-2")


def started(launcher: Launcher) -> list[tuple[str, float]]:
    """(name, time) of each process started since the launcher was ready."""
    return [(name, time) for name, _, time in launcher.starts]


def check(launcher: Launcher, now: float) -> str | None:
    """The launcher's check at ``now`` on its clock: why it stops, or None."""
    launcher.clock = now
    return launcher._failure(now)


def flag(argv: list[str], name: str, default: str | None = None) -> str:
    """The value of flag ``name`` in ``argv`` (``default`` when it is left out: the role's)."""
    return argv[argv.index(name) + 1] if name in argv or default is None else default


def test_the_budget_is_a_sliding_minute():
    budget = WorkerRestartBudget(limit=3)
    for now in (0.0, 10.0, 20.0):
        assert budget.allows(now)
        budget.spend(now)
    assert not budget.allows(59.9) and budget.used(59.9) == 3
    assert budget.allows(60.0) and budget.used(60.0) == 2  # the one at 0 s left the window
    budget.spend(60.0)
    assert not budget.allows(69.9)
    assert budget.used(200.0) == 0


def test_a_negative_limit_is_refused(tmp_path):
    with pytest.raises(ValueError, match="--restart-limit must be at least 0, got -1"):
        ServeConfig(tmp_path, "model", restart_limit=-1)


def test_a_dead_worker_is_started_again_under_its_group_name(make_launcher, caplog):
    launcher = make_launcher()
    old_scheduler = launcher.children["scheduler"]
    launcher.children["worker"].returncode = -9
    with caplog.at_level(logging.INFO, logger="switchyard"):
        assert check(launcher, 0.25) is None
    ((name, argv, time),) = launcher.starts
    assert (name, time) == ("worker", 0.25)
    assert flag(argv, "--group") == "hybrid"
    assert launcher.children["worker"].poll() is None
    assert launcher.children["scheduler"] is old_scheduler
    assert caplog.messages == [
        "worker exited with code -9; starting worker group 'hybrid' again (1 of 5 restarts "
        "a minute)",
        "started worker group 'hybrid' again: worker",
    ]
    assert check(launcher, 0.5) is None and len(launcher.starts) == 1


def test_a_dead_rank_has_its_group_stopped_and_started_together_on_a_fresh_port(
    make_launcher, monkeypatch
):
    ports = iter(range(40000, 40010))
    monkeypatch.setattr("switchyard.launcher._free_port", lambda: next(ports))
    launcher = make_launcher(worker=WorkerSettings(tensor_parallel_size=3))
    first = {name: launcher.children[name] for name in TP_RANKS}
    first["worker-1"].returncode = -9
    assert check(launcher, 1.0) is None
    assert first["worker-0"].signals == first["worker-2"].signals == [signal.SIGTERM]
    assert first["worker-1"].signals == []
    assert started(launcher) == [(name, 1.0) for name in TP_RANKS]
    argvs = [argv for _, argv, _ in launcher.starts]
    assert [flag(argv, "--master-port") for argv in argvs] == ["40001"] * 3  # 40000 before
    assert [flag(argv, "--rank", "0") for argv in argvs] == ["0", "1", "2"]
    assert launcher.worker_groups.budget.used(1.0) == 1


def test_ranks_blocked_in_a_collective_are_killed_after_the_bound(make_launcher):
    launcher = make_launcher(worker=WorkerSettings(tensor_parallel_size=3))
    ranks = [launcher.children[name] for name in TP_RANKS]
    for rank in ranks:
        rank.exits_on = frozenset()  # SIGTERM does not get it out of the collective
    ranks[2].returncode = 1
    assert check(launcher, 0.0) is None
    assert check(launcher, GROUP_STOP_TIMEOUT_S - 0.25) is None
    assert launcher.starts == [] and ranks[0].signals == [signal.SIGTERM]
    assert check(launcher, GROUP_STOP_TIMEOUT_S) is None  # killed now ...
    assert ranks[0].signals == ranks[1].signals == [signal.SIGTERM, signal.SIGKILL]
    assert check(launcher, GROUP_STOP_TIMEOUT_S + 0.25) is None  # ... and started again
    assert started(launcher) == [(name, GROUP_STOP_TIMEOUT_S + 0.25) for name in TP_RANKS]
    assert launcher.worker_groups.budget.used(10.0) == 1


def test_a_death_past_the_limit_stops_the_unit_and_the_window_slides(make_launcher):
    launcher = make_launcher(restart_limit=2)
    for now in (0.0, 30.0):
        launcher.children["worker"].returncode = -9
        assert check(launcher, now) is None
    launcher.children["worker"].returncode = -9
    assert check(launcher, 59.75) == (
        "worker exited with code -9; worker groups or the scheduler were restarted 2 time(s) "
        "in the last 60 s already (--restart-limit 2)"
    )
    assert check(launcher, 60.0) is None  # the restart at 0 s is a minute old
    assert started(launcher) == [("worker", 0.0), ("worker", 30.0), ("worker", 60.0)]


@pytest.mark.parametrize(
    "config",
    [{"restart_limit": 0}, {"scheduler": SchedulerConfig(migration_limit=0)}],
    ids=["restart-limit-0", "migration-limit-0"],
)
def test_with_restarts_off_a_dead_worker_stops_the_unit_as_before(make_launcher, config):
    launcher = make_launcher(worker=WorkerSettings(tensor_parallel_size=3), **config)
    launcher.children["worker-1"].returncode = -9
    assert check(launcher, 0.0) == "worker-1 exited with code -9"
    assert launcher.starts == []
    assert all(launcher.children[name].signals == [] for name in TP_RANKS)
    launcher._become_ready()
    assert launcher._health_poller is None  # nothing reads /health for groups away


def test_a_dead_scheduler_is_started_again_and_its_tensor_parallel_groups_after_it(
    make_launcher, tmp_path, caplog
):
    """A scheduler death is one fault: the scheduler starts again and every tensor-parallel
    group is stopped and started again with it (its ranks exit when their scheduler goes
    away), for one restart of the limit however many groups there are; a one-process group
    (here the embedding worker) stays and registers with the new scheduler by itself; API
    servers wait meanwhile."""
    launcher = make_launcher(
        restart_limit=2,
        prefill_workers=1,
        decode_workers=1,
        embedding_model_dir=tmp_path,
        embedding_model_name="vectors",
        worker=WorkerSettings(tensor_parallel_size=2),
    )
    api_server_argv = launcher._api_server_argv("ipc://frontend", 3)
    assert flag(api_server_argv, "--scheduler-return-timeout", "60.0") == "60.0"
    workers = ("prefill-0-0", "prefill-0-1", "decode-0-0", "decode-0-1")
    old = {name: launcher.children[name] for name in (*workers, "embedding-worker")}
    old["decode-0-1"].exits_on = frozenset()  # blocked in a collective: SIGKILL ends it
    launcher.children["scheduler"].returncode = -9
    with caplog.at_level(logging.INFO, logger="switchyard"):
        assert check(launcher, 0.0) is None
    assert [old[name].signals for name in workers] == [[signal.SIGTERM]] * 4
    assert old["embedding-worker"].signals == []
    assert launcher.children["embedding-worker"] is old["embedding-worker"]
    assert started(launcher) == [("scheduler", 0.0), ("prefill-0-0", 0.0), ("prefill-0-1", 0.0)]
    assert caplog.messages == [
        "scheduler exited with code -9; starting it again (1 of 2 restarts a minute); "
        "tensor-parallel worker groups start again with it, the others register again; the "
        "API servers submit their streams again",
        "started worker group 'prefill-0' again: prefill-0-0, prefill-0-1",
    ]
    assert check(launcher, GROUP_STOP_TIMEOUT_S) is None  # the blocked rank is killed ...
    assert old["decode-0-1"].signals == [signal.SIGTERM, signal.SIGKILL]
    assert check(launcher, GROUP_STOP_TIMEOUT_S + 0.25) is None  # ... and its group started
    assert started(launcher)[3:] == [(name, GROUP_STOP_TIMEOUT_S + 0.25) for name in workers[2:]]
    assert launcher.worker_groups.budget.used(10.0) == 1  # one fault, one restart
    launcher.children["scheduler"].returncode = -9
    assert check(launcher, 10.0) is None  # the second restart of the minute
    assert launcher.worker_groups.budget.used(10.0) == 2 and len(launcher.starts) == 10
    launcher.children["scheduler"].returncode = -9
    assert check(launcher, 20.0) == (
        "scheduler exited with code -9; worker groups or the scheduler were restarted 2 "
        "time(s) in the last 60 s already (--restart-limit 2)"
    )


def test_one_process_groups_stay_when_the_scheduler_dies(make_launcher, caplog):
    launcher = make_launcher(restart_limit=5)
    worker = launcher.children["worker"]
    launcher.children["scheduler"].returncode = -9
    with caplog.at_level(logging.INFO, logger="switchyard"):
        assert check(launcher, 0.0) is None
    assert worker.signals == [] and launcher.children["worker"] is worker
    assert started(launcher) == [("scheduler", 0.0)]
    assert caplog.messages == [
        "scheduler exited with code -9; starting it again (1 of 5 restarts a minute); the "
        "worker groups register with it again; the API servers submit their streams again"
    ]


def test_a_group_restarting_when_the_scheduler_dies_is_started_once(make_launcher):
    launcher = make_launcher(restart_limit=5, worker=WorkerSettings(tensor_parallel_size=3))
    ranks = [launcher.children[name] for name in TP_RANKS]
    ranks[0].exits_on = frozenset()
    ranks[2].returncode = -9
    assert check(launcher, 0.0) is None  # stopping: rank 0 has not exited yet
    launcher.children["scheduler"].returncode = -9
    assert check(launcher, 0.25) is None
    assert ranks[0].signals == [signal.SIGTERM]  # not signalled twice
    assert started(launcher) == [("scheduler", 0.25)]
    assert check(launcher, GROUP_STOP_TIMEOUT_S) is None
    assert check(launcher, GROUP_STOP_TIMEOUT_S + 0.25) is None
    assert started(launcher)[1:] == [(name, GROUP_STOP_TIMEOUT_S + 0.25) for name in TP_RANKS]
    assert launcher.worker_groups.budget.used(10.0) == 2


def test_with_restarts_off_a_dead_scheduler_stops_the_unit_and_streams_do_not_wait(
    make_launcher,
):
    launcher = make_launcher(restart_limit=0)
    assert flag(launcher._api_server_argv("ipc://frontend", 3), "--scheduler-return-timeout") == (
        "0.0"
    )
    launcher.children["scheduler"].returncode = -9
    assert check(launcher, 0.0) == "scheduler exited with code -9"
    assert launcher.starts == []


def test_a_worker_that_dies_before_the_unit_was_ready_stops_it(make_launcher):
    launcher = make_launcher()
    launcher._ready = False
    launcher.children["worker"].returncode = 1
    assert check(launcher, 0.0) == "worker exited with code 1"
    assert launcher.starts == []


def test_each_disaggregated_group_and_the_embedding_worker_restart_alone(make_launcher, tmp_path):
    launcher = make_launcher(
        prefill_workers=1,
        decode_workers=2,
        embedding_model_dir=tmp_path,
        embedding_model_name="vectors",
    )
    assert set(launcher.worker_groups.groups) == {"prefill-0", "decode-0", "decode-1", "embedding"}
    untouched = launcher.children["decode-0"]
    launcher.children["decode-1"].returncode = -9
    launcher.children["embedding-worker"].returncode = -9
    assert check(launcher, 0.0) is None
    assert started(launcher) == [("decode-1", 0.0), ("embedding-worker", 0.0)]
    decode_argv = launcher.starts[0][1]
    assert (flag(decode_argv, "--role"), flag(decode_argv, "--group")) == ("decode", "decode-1")
    assert flag(launcher.starts[1][1], "--group") == "embedding"
    assert launcher.children["decode-0"] is untouched and untouched.signals == []
    assert launcher.worker_groups.budget.used(0.0) == 2


class Poller:
    """A stand-in ``HealthPoller`` handing out the reports a test gives it, each once."""

    def __init__(self) -> None:
        self.reports: list[AwayReport] = []

    def take(self) -> AwayReport | None:
        return self.reports.pop(0) if self.reports else None


def test_a_group_away_whose_processes_run_is_killed_and_started_again(make_launcher, caplog):
    launcher = make_launcher(worker=WorkerSettings(tensor_parallel_size=3))
    launcher._health_poller = poller = Poller()
    ranks = [launcher.children[name] for name in TP_RANKS]
    ranks[1].exits_on = frozenset()  # SIGSTOPped: only SIGKILL ends it
    poller.reports.append(AwayReport(100.0, (AwayEntry("hybrid", "worker_stalled", 4.0),)))
    with caplog.at_level(logging.ERROR, logger="switchyard"):
        assert check(launcher, 100.25) is None
    assert [rank.signals for rank in ranks] == [[signal.SIGKILL]] * 3
    assert started(launcher) == [(name, 100.25) for name in TP_RANKS]
    assert caplog.messages == [
        "worker group 'hybrid' left the scheduler 4.0 s ago (worker_stalled) while its "
        "processes run; starting worker group 'hybrid' again (1 of 5 restarts a minute)"
    ]
    # Until the new ranks register, /health still names the group: they are left alone.
    poller.reports.append(AwayReport(110.0, (AwayEntry("hybrid", "worker_stalled", 14.0),)))
    assert check(launcher, 110.25) is None
    assert len(launcher.starts) == 3 and launcher.worker_groups.budget.used(110.25) == 1


def test_groups_away_that_are_not_ours_to_kill_are_left_alone(make_launcher):
    launcher = make_launcher()
    launcher._health_poller = poller = Poller()
    worker = launcher.children["worker"]
    # Started 2.5 s before the report: within the margin of a departure 0.5 s before it.
    launcher.worker_groups.groups["hybrid"].started_at = 10.0 - AWAY_MARGIN_S - 0.5
    for away in (AwayEntry("hybrid", "worker_died", 0.5), AwayEntry("elsewhere", "x", 50.0)):
        poller.reports.append(AwayReport(10.0, (away,)))
        assert check(launcher, 10.0) is None
    assert worker.signals == [] and launcher.starts == []
    poller.reports.append(AwayReport(10.0, (AwayEntry("hybrid", "worker_died", 0.49),)))
    assert check(launcher, 10.0) is None
    assert worker.signals == [signal.SIGKILL]


def test_a_group_away_past_the_limit_stops_the_unit(make_launcher):
    launcher = make_launcher(restart_limit=1)
    launcher._health_poller = poller = Poller()
    launcher.children["worker"].returncode = -9
    assert check(launcher, 0.0) is None
    poller.reports.append(AwayReport(20.0, (AwayEntry("hybrid", "worker_stalled", 5.0),)))
    assert check(launcher, 20.0) == (
        "worker group 'hybrid' left the scheduler 5.0 s ago (worker_stalled) while its "
        "processes run; worker groups or the scheduler were restarted 1 time(s) in the last "
        "60 s already (--restart-limit 1)"
    )


def test_groups_away_are_read_from_the_health_body_and_checked():
    away = {"group": "hybrid", "reason": "worker_stalled", "seconds": 3}
    assert parse_groups_away(json.dumps({"status": "ok"}).encode()) == ()
    longest = {**away, "group": "\u00e9" * 256, "seconds": 12345.678901}
    most = json.dumps({"groups_away": [longest] * MAX_GROUPS_AWAY}).encode()
    assert len(most) <= MAX_BODY_BYTES and len(parse_groups_away(most)) == MAX_GROUPS_AWAY
    body = {"status": "stalled", "groups_away": [away, {**away, "group": "b", "seconds": 0.5}]}
    assert parse_groups_away(json.dumps(body).encode()) == (
        AwayEntry("hybrid", "worker_stalled", 3.0),
        AwayEntry("b", "worker_stalled", 0.5),
    )
    for bad in (
        b"not json",
        b"[]",
        json.dumps({"groups_away": {"hybrid": 1}}).encode(),
        json.dumps({"groups_away": [away] * (MAX_GROUPS_AWAY + 1)}).encode(),
        json.dumps({"groups_away": [{**away, "seconds": -1}]}).encode(),
        json.dumps({"groups_away": [{**away, "seconds": True}]}).encode(),
        json.dumps({"groups_away": [{**away, "seconds": "3"}]}).encode(),
        json.dumps({"groups_away": [{**away, "group": "x" * 257}]}).encode(),
        json.dumps({"groups_away": [{**away, "reason": None}]}).encode(),
        b'{"groups_away": [{"group": "a", "reason": "r", "seconds": NaN}]}',
        b'{"groups_away": [{"group": "a", "reason": "r", "seconds": Infinity}]}',
    ):
        assert parse_groups_away(bad) is None, bad


def test_the_poller_reports_each_200_answer_once_and_nothing_else():
    away = {"group": "g", "reason": "r", "seconds": 1}
    answers = [
        (200, {"status": "restarting", "groups_away": [away]}),
        (503, {"status": "unavailable"}),
        (200, {"status": "ok"}),
    ]

    class Health(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            status, body = answers.pop(0)
            payload = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *_args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        poller = HealthPoller(f"http://127.0.0.1:{server.server_port}/health", threading.Event())
        report = poller._fetch()
        assert report is not None and report.groups == (AwayEntry("g", "r", 1.0),)
        assert poller._fetch() is None  # 503: nothing to act on
        assert poller._fetch().groups == ()
        assert poller.take() is None  # _fetch itself stores nothing
    finally:
        server.shutdown()
        server.server_close()


def test_an_unexpected_error_is_logged_once_per_kind_and_polling_goes_on(monkeypatch, caplog):
    poller = HealthPoller("http://127.0.0.1:9/health", threading.Event())
    report = AwayReport(1.0, (AwayEntry("g", "worker_died", 1.0),))
    outcomes = [RuntimeError("a"), RuntimeError("b"), KeyError("c"), report]

    def fetch() -> AwayReport:
        outcome = outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    monkeypatch.setattr(poller, "_fetch", fetch)
    with caplog.at_level(logging.ERROR, logger="switchyard"):
        for _ in range(4):
            poller._poll()
    assert [record.exc_info[0] for record in caplog.records] == [RuntimeError, KeyError]
    assert caplog.messages[0] == (
        "reading http://127.0.0.1:9/health for groups away failed; polling goes on (this "
        "RuntimeError is logged once)"
    )
    assert poller.take() == report
