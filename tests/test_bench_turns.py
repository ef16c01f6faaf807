"""bench/run.py's rows taking turns with MXNet's, and bench/common.py's processes that
measure on command (what `make bench` runs them with; MXNet itself is not needed here)."""
import os
import sys
import textwrap

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
sys.path.insert(0, BENCH)

import common  # noqa: E402  (bench/common.py)
import run  # noqa: E402  (bench/run.py)


def side(name, calls):
    """A side of take_turns: one worker whose round trips are numbered in order."""
    def seconds(count):
        done = sum(n for who, n in calls if who == name)
        calls.append((name, count))
        return [[float(done + i) for i in range(count)]]
    return seconds


def test_rows_take_turns_with_mxnets_in_abba_order():
    calls = []
    ours, theirs = run.take_turns([side("tensorkv", calls), side("mxnet", calls)], 16, turns=3)
    assert calls == [("tensorkv", 6), ("mxnet", 6), ("mxnet", 5), ("tensorkv", 5), ("tensorkv", 5), ("mxnet", 5)]
    assert ours == theirs == [[float(i) for i in range(16)]]


def test_without_mxnet_a_row_is_one_turn_of_its_own():
    calls = []
    ours, theirs = run.take_turns([side("tensorkv", calls), None], 7, turns=3)
    assert calls == [("tensorkv", 7)] and theirs is None and ours == [[float(i) for i in range(7)]]


def test_a_reference_takes_its_turns_with_both_in_mirrored_order():
    calls = []
    ours, theirs, raw = run.take_turns([side("tensorkv", calls), None, side("raw", calls)], 6, turns=3)
    assert calls == [("tensorkv", 2), ("raw", 2), ("raw", 2), ("tensorkv", 2), ("tensorkv", 2), ("raw", 2)]
    assert theirs is None and ours == raw == [[float(i) for i in range(6)]]
    calls = []
    run.take_turns([side("tensorkv", calls), side("mxnet", calls), side("raw", calls)], 3, turns=3)
    assert calls == [("tensorkv", 1), ("mxnet", 1), ("raw", 1), ("raw", 1), ("mxnet", 1), ("tensorkv", 1),
                     ("tensorkv", 1), ("mxnet", 1), ("raw", 1)]


def test_round_trips_warm_up_once_and_count_on_across_turns():
    seen = []
    trips = run.RoundTrips(prepare=lambda i: seen.append(("prepare", i)), op=lambda i: None,
                           check=lambda i: seen.append(("check", i)), warmup=2)
    assert len(trips.seconds(3)) == 3 and len(trips.seconds(2)) == 2
    assert [i for what, i in seen if what == "check"] == list(range(7))  # 2 untimed, then 3 and 2 timed


def test_batched_round_trips_run_back_to_back_between_their_prepares_and_checks():
    seen = []
    trips = run.RoundTrips(prepare=lambda i: seen.append(("prepare", i)), op=lambda i: seen.append(("op", i)),
                           check=lambda i: seen.append(("check", i)), warmup=1, batched=True)
    assert len(trips.seconds(2)) == 2
    assert seen == [("prepare", 0), ("prepare", 1), ("prepare", 2), ("op", 0), ("op", 1), ("op", 2),
                    ("check", 0), ("check", 1), ("check", 2)]
    seen.clear()  # a later call makes one untimed round trip first too, past both workers' prepares
    assert len(trips.seconds(1)) == 1
    assert seen == [("prepare", 3), ("prepare", 4), ("op", 3), ("op", 4), ("check", 3), ("check", 4)]


WORKER = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    import common

    def start():
        print("a library's message on stdout")
        return lambda command: {"twice": 2 * command["n"]} if command["n"] >= 0 else sys.exit(3)

    common.serve_commands(start)
""")


def test_processes_answer_commands_on_their_own_lines(tmp_path):
    procs = [common.spawn_on_command([sys.executable, "-c", WORKER, BENCH], dict(os.environ),
                                     str(tmp_path / f"worker{i}.log")) for i in range(2)]
    try:
        common.wait_ready(procs, timeout=60)
        assert common.ask(procs, {"n": 4}, timeout=60) == [{"twice": 8}, {"twice": 8}]
        assert common.ask(procs, {"n": 5}, timeout=60) == [{"twice": 10}, {"twice": 10}]
        with pytest.raises(RuntimeError, match="exited before answering"):
            common.ask(procs, {"n": -1}, timeout=60)
    finally:
        common.stop_on_command(procs)
    assert [proc.poll() for proc in procs] == [3, 3]
    assert "a library's message on stdout" in (tmp_path / "worker0.log").read_text()


def test_a_process_that_does_not_answer_in_time_is_named(tmp_path):
    proc = common.spawn_on_command([sys.executable, "-c", "import time; time.sleep(60)"], dict(os.environ),
                                   str(tmp_path / "silent.log"))
    try:
        with pytest.raises(RuntimeError, match=f"pid {proc.pid}.* did not answer within 1s"):
            common.ask([proc], {"n": 1}, timeout=1)
    finally:
        common.stop_on_command([proc])
    assert proc.poll() is not None


def test_a_process_that_dies_is_named_not_the_one_left_waiting(tmp_path):
    """One worker of a pair exits on its command while the other waits for it (as a ps-lite
    worker would): the one that exited is named, with its log, at once."""
    dying = common.spawn_on_command(
        [sys.executable, "-c", "import sys; sys.stdin.readline(); print('the cause', file=sys.stderr); sys.exit(1)"],
        dict(os.environ), str(tmp_path / "dying.log"))
    waiting = common.spawn_on_command([sys.executable, "-c", "import time; time.sleep(60)"], dict(os.environ),
                                      str(tmp_path / "waiting.log"))
    try:
        with pytest.raises(RuntimeError, match=f"(?s)pid {dying.pid}.* exited before answering.*the cause"):
            common.ask([waiting, dying], {"n": 1}, timeout=60)
    finally:
        common.stop_on_command([dying, waiting])
    assert dying.poll() == 1 and waiting.poll() is not None


def test_an_answer_that_is_not_json_is_named(tmp_path):
    proc = common.spawn_on_command(
        [sys.executable, "-c", "import sys; sys.stdin.readline(); print('garbage', flush=True); sys.stdin.read()"],
        dict(os.environ), str(tmp_path / "garbage.log"))
    try:
        with pytest.raises(RuntimeError, match=f"pid {proc.pid}.* answered b'garbage\\\\n', not one JSON line"):
            common.ask([proc], {"n": 1}, timeout=60)
    finally:
        common.stop_on_command([proc])
    assert proc.poll() == 0


def test_the_raw_tcp_sum_reference_sums_two_clients_and_stops_its_processes():
    import multiprocessing
    import references  # noqa: E402  (bench/references.py)
    before = {child.pid for child in multiprocessing.active_children()}
    with references.tcp_sum(64 << 10) as seconds:
        first, second = seconds(3), seconds(2)  # each client checks the last sum it got back (1 + 2)
        started = [child for child in multiprocessing.active_children() if child.pid not in before]
    assert [len(times) for times in first] == [3, 3] and [len(times) for times in second] == [2, 2]
    assert len(started) == 3 and not any(child.is_alive() for child in started)


def test_a_raw_tcp_sum_client_that_died_is_named():
    import references  # noqa: E402  (bench/references.py)
    with references.tcp_sum(64 << 10) as seconds:
        seconds(1)
        import multiprocessing
        client = next(child for child in multiprocessing.active_children() if child.name == "tcp-sum-client-1")
        client.kill()
        client.join(10)
        with pytest.raises(RuntimeError, match=f"TCP sum client \\(pid {client.pid}\\) exited with -9"):
            seconds(1)


def test_the_raw_tcp_echo_takes_turns_a_count_at_a_time():
    import references  # noqa: E402  (bench/references.py)
    with references.tcp_echo_turns(64 << 10) as seconds:
        assert [len(times) for times in seconds(3)] == [3]
        assert [len(times) for times in seconds(2)] == [2]


def goal_row(tensorkv, mxnet, raw):
    return run._row("pair", "2 workers 4 MiB aggr.", "GB/s", True, "tcp-only", tensorkv,
                    [("MXNet", mxnet), ("TCP sum", raw)])


def test_a_missed_goal_says_when_it_asks_more_than_raw_sockets_moved():
    table = [goal_row(2.7, 2.25, 3.0)]
    status = {g["goal"]: g["status"] for g in run.goals(table, run.FULL)}
    assert status["2 workers, 4 MiB, aggregate >= 1.5x MXNet (tcp-only)"] == (
        "missed (it asks 3.38 GB/s, 1.12x the raw TCP sum of this run)")
    table = [goal_row(2.7, 1.9, 3.0)]  # 1.5x MXNet is within what the raw sum moved: a plain miss
    status = {g["goal"]: g["status"] for g in run.goals(table, run.FULL)}
    assert status["2 workers, 4 MiB, aggregate >= 1.5x MXNet (tcp-only)"] == "missed"
    table = [run._row("local", "'local' 4 MiB", "GB/s", True, "embedded", 20.0,
                      [("MXNet", 30.0), ("NumPy copy", 25.0)]),  # a copy in memory is no bound of the wire
             run._row("pair", "2 workers 4 MiB aggr.", "GB/s", True, "same-host", 2.7,
                      [("MXNet", 2.25), ("TCP sum", 3.0)])]  # nor is TCP of shared memory
    status = {g["goal"]: g["status"] for g in run.goals(table, run.FULL)}
    assert status["'local' 4 MiB >= 1.0x MXNet 'local'"] == "missed"
    assert status["2 workers, 4 MiB, aggregate >= 1.5x MXNet (same-host)"] == "missed"
