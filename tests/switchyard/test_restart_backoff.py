"""The launcher's restart policy for API servers (docs/reliability.md, fault 3): exact delays and
decisions, with processes that are stand-ins and a clock that the test moves.
tests/e2e/test_faults.py shows the same with real processes."""

from __future__ import annotations

import pytest

from switchyard.launcher import Launcher
from switchyard.restart_backoff import API_SERVER_OUTAGE_LIMIT_S, RestartBackoff


def test_exits_in_a_row_wait_twice_as_long_each_time_up_to_30_s():
    backoff = RestartBackoff()
    now, delays = 0.0, []
    backoff.started(now)
    for _ in range(9):
        now += 1.0  # each run lasts a second
        delays.append(backoff.crashed(now))
        assert backoff.is_waiting and not backoff.is_due(now + delays[-1] - 0.01)
        now += delays[-1]
        assert backoff.is_due(now)
        backoff.started(now)
        assert not backoff.is_waiting
    assert delays == [0.5, 1, 2, 4, 8, 16, 30, 30, 30]
    assert backoff.exits_in_a_row == 9


def test_a_run_of_a_minute_makes_the_next_exit_the_first_again():
    backoff = RestartBackoff()
    backoff.started(0.0)
    assert [backoff.crashed(t) for t in (1.0, 3.0, 5.0)] == [0.5, 1, 2]  # no restart between
    backoff.started(10.0)
    assert backoff.crashed(69.9) == 4  # 59.9 s: not long enough
    backoff.started(80.0)
    assert backoff.crashed(140.0) == 0.5
    assert backoff.exits_in_a_row == 1


def test_failing_for_counts_from_the_first_exit_until_a_run_of_a_minute():
    backoff = RestartBackoff()
    backoff.started(0.0)
    assert backoff.failing_for(1000.0) == 0  # never exited
    backoff.crashed(10.0)
    assert backoff.failing_for(12.0) == 2.0
    backoff.started(10.5)
    assert backoff.failing_for(70.0) == 60.0  # up for 59.5 s: not yet
    assert backoff.failing_for(70.5) == 0  # up for a minute
    backoff.crashed(200.0)
    assert backoff.failing_for(201.0) == 1.0


@pytest.fixture
def launcher(make_launcher):
    """A ready launcher of a scheduler, a worker and two API servers, all stand-ins
    (``conftest.make_launcher``)."""
    return make_launcher()


def run_until(launcher: Launcher, end: float, crashing: tuple[str, ...] = ()) -> str | None:
    """Call the launcher's check every 0.25 s of the test's clock until ``end`` or a failure;
    every process of the API servers ``crashing`` exits (code -9) as soon as it runs. Returns
    the failure (None: none); ``launcher.crashes`` gets (name, time) of each exit."""
    while launcher.clock < end:
        for name in crashing:
            if launcher.children[name].poll() is None:
                launcher.children[name].returncode = -9
                launcher.crashes.append((name, launcher.clock))
        failure = launcher._failure(launcher.clock)
        if failure is not None:
            return failure
        launcher.clock += 0.25
    return None


def test_an_api_server_that_keeps_crashing_is_restarted_ever_later_and_stops_nothing(launcher):
    assert run_until(launcher, 200.0, crashing=("api-server-1",)) is None
    starts = [time for name, _, time in launcher.starts if name == "api-server-1"]
    crashes = [time for name, time in launcher.crashes if name == "api-server-1"]
    assert len(crashes) == len(starts) + 1 == 12  # the last restart is due after 200 s
    waits = [start - crash for crash, start in zip(crashes, starts, strict=False)]
    assert waits == [0.5, 1, 2, 4, 8, 16, 30, 30, 30, 30, 30]
    assert {name for name, _, _ in launcher.starts} == {"api-server-1"}
    assert launcher.children["api-server-0"].poll() is None  # never touched


def test_the_unit_stops_only_when_no_api_server_has_stayed_up_for_five_minutes(launcher):
    assert run_until(launcher, 100.0, crashing=("api-server-0",)) is None
    both = ("api-server-0", "api-server-1")  # from 100 s on, both crash as soon as they run
    assert run_until(launcher, 100.0 + API_SERVER_OUTAGE_LIMIT_S, both) is None
    failure = run_until(launcher, 1000.0, both)
    assert failure == "no API server has stayed up for 300 s"
    assert launcher.clock == 100.0 + API_SERVER_OUTAGE_LIMIT_S


def test_a_dead_scheduler_stops_the_unit_at_once_with_restarts_off(make_launcher):
    launcher = make_launcher(restart_limit=0)
    launcher.children["scheduler"].returncode = 1
    assert launcher._failure(0.0) == "scheduler exited with code 1"


def test_an_api_server_that_dies_before_the_unit_is_ready_stops_it(launcher):
    launcher._ready = False
    launcher.children["api-server-0"].returncode = 2  # e.g. a bad flag: restarting won't help
    assert launcher._failure(0.0) == "api-server-0 exited with code 2"
