"""Seeded, randomized failure scenarios (issue 11's robustness suite, after etcd's): real
servers and worker processes on 127.0.0.1, faults from real mechanisms (connections reset,
stalled or their answers lost by tests/faultproxy.py; servers killed with -9 and restarted
on their state dir; a worker killed with -9 or paused past its lease, then replaced). Every
scenario checks that nothing hangs (every wait is bounded), that no acknowledged update is
lost or applied twice (integer-valued SGD: every value is exactly what the updates the
servers report make it), that the workers raise only the documented errors, and that server
memory stays bounded. The seed is in each test's id: ``make robustness SEED=S`` replays one."""
import json
import os
import random
import signal
import time

from tensorkv.wire.codec import get_key
from tensorkv.tools.ctl import Server
from tensorkv.transport.security import Security

from cluster import WAIT, Cluster, DrivenWorker, check_workers, rss, stop, wait_until
from faultproxy import FaultProxy

KEYS = {"a": 4, "b": 4, **{f"p{i}": 2 for i in range(12)}, "big": 16}  # as tests/workers/robust_rounds.py
WORKERS = 2
SCENARIO_TIMEOUT = 150.0  # seconds a scenario's workers get to finish
RSS_GROWTH = 200 << 20  # bytes a server may grow by during a scenario


def _updates(addresses):
    """[{key: updates}] that each server reports (the rounds it applied to each key it holds)."""
    return [{get_key(key.key): key.updates for key in Server(address, Security(), 10.0).keys()}
            for address in addresses]


def _expected(updates):
    """Each key's value after the updates the servers report: 1000 - WORKERS per round."""
    weights = []
    for key, size in KEYS.items():
        holders = [counts[key] for counts in updates if key in counts]
        per_slice = size // len(holders)
        weights.append([float(1000 - WORKERS * count) for count in holders for _ in range(per_slice)])
    return weights


def _finish(workers):
    """[(returncode, stdout, stderr)] of ``workers``, each stopped by its PID if it overruns."""
    deadline = time.monotonic() + SCENARIO_TIMEOUT
    results = []
    for worker in workers:
        try:
            out, err = worker.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except Exception:
            stop(worker)
            out, err = worker.communicate()
            err += f"\n[worker stopped after {SCENARIO_TIMEOUT} s]"
        results.append((worker.returncode, out, err))
    return results


def test_reset_stalled_and_unanswered_connections_lose_and_double_nothing(seed, tmp_path):
    """Faults on the workers' connections from their start on, create's Info, Register and
    set_optimizer included (a reset there is tried again within connect_timeout; a Register
    sent again keeps its request_id, so the server makes one registration)."""
    rng = random.Random(seed)
    rounds = rng.randint(10, 25)
    with Cluster(servers=rng.choice([1, 2]), num_workers=WORKERS, tmp_path=tmp_path) as cluster:
        memory = [rss(process.pid) for process in cluster.processes]
        proxies = [[FaultProxy(address) for address in cluster.addresses] for _ in range(WORKERS)]
        workers = [cluster.start_worker("robust_rounds", rounds, "check", 0, env={
            "TENSORKV_SERVERS": ",".join(proxy.address for proxy in own), "TENSORKV_RANK": str(rank)})
            for rank, own in enumerate(proxies)]
        faults = []
        try:
            deadline = time.monotonic() + SCENARIO_TIMEOUT
            while any(worker.poll() is None for worker in workers) and time.monotonic() < deadline:
                time.sleep(rng.uniform(0.05, 0.5))
                proxy = rng.choice(rng.choice(proxies))
                fault = rng.choice(["reset", "stall", "lost answer"])
                faults.append(fault)
                if fault == "reset":
                    proxy.reset()
                elif fault == "stall":
                    proxy.stall(rng.uniform(0.1, 1.5))
                else:  # the server gets the call, its answer never comes back
                    proxy.hold_replies()
                    time.sleep(rng.uniform(0.05, 0.3))
                    proxy.reset()
                    proxy.hold_replies(False)
            results = _finish(workers)
        finally:
            for worker in workers:
                stop(worker)
            for own in proxies:
                for proxy in own:
                    proxy.close()
        outs = check_workers(results)
        updates = _updates(cluster.addresses)
        assert all(rss(process.pid) - before < RSS_GROWTH for process, before in zip(cluster.processes, memory))
    assert faults, "no fault was injected"
    assert all(count == rounds for counts in updates for count in counts.values()), (updates, faults)
    for out in outs:
        assert json.loads(out.splitlines()[-1])["weights"] == _expected(updates), (faults, updates)


def test_a_server_killed_and_restarted_on_its_state_dir_loses_only_unsnapshotted_rounds(seed, tmp_path):
    """A server killed with -9 once every worker has seen round ``k`` complete (while they
    compute: not in the instant between a round's completion and its answers, the case the
    README names as one a restart cannot line up) and restarted on its state dir."""
    rng = random.Random(seed)
    rounds, kill_after = rng.randint(12, 20), rng.randint(2, 8)
    server_args = ("--state-dir", str(tmp_path / "state{index}"), "--snapshot-interval", str(rng.uniform(0.1, 0.5)))
    with Cluster(servers=2, num_workers=WORKERS, tmp_path=tmp_path, server_args=server_args) as cluster:
        victim = rng.randrange(2)
        workers = [cluster.start_worker("robust_rounds", rounds, "nocheck", 0.3) for _ in range(WORKERS)]
        try:
            for worker in workers:
                for line in worker.stdout:  # bounded: the worker ends, or prints every round
                    if line == f"round {kill_after}\n":
                        break
            cluster.restart(victim)
            results = _finish(workers)
        finally:
            for worker in workers:
                stop(worker)
        outs = check_workers(results)
        restarted = Server(cluster.addresses[victim], Security(), 10.0).info()
        updates = _updates(cluster.addresses)
    assert restarted.restored_from, restarted
    for _, _, err in results:
        warnings = [line for line in err.splitlines() if "restarted" in line and cluster.addresses[victim] in line]
        assert len(warnings) == 1, err
    weights = [json.loads(out.splitlines()[-1])["weights"] for out in outs]
    assert all(w == _expected(updates) for w in weights), (updates, weights)


def _holders(address):
    """The registered ranks of the server at ``address``."""
    return set(Server(address, Security(), 10.0).info().registered_ranks)


def test_a_worker_killed_or_paused_past_its_lease_is_replaced_and_nothing_it_sent_late_is_merged(seed, tmp_path):
    """Rank 0 pushes 1 and rank 1 pushes 2 each round (SGD adds each round's sum: 3 a round).
    After a random number of rounds rank 1 is killed with -9 or paused (SIGSTOP) past its
    lease, with or without its push of the round in flight; a replacement takes rank 1 and the
    job goes on. A paused worker that wakes is refused (FailedPreconditionError), and the
    value is 3 x the rounds completed, exactly."""
    rng = random.Random(seed)
    lease = rng.choice([1.0, 1.5])
    with Cluster(num_workers=2, tmp_path=tmp_path, server_args=("--lease-timeout", str(lease))) as cluster:
        started = []
        try:
            started += [DrivenWorker(cluster, 0), DrivenWorker(cluster, 1)]
            survivor, lost = started
            rounds = 0
            for _ in range(rng.randint(0, 3)):
                _round(survivor, lost, rounds := rounds + 1)
            paused, lost_pushed = rng.random() < 0.5, rng.random() < 0.5
            if lost_pushed:  # the round holds rank 1's push: its replacement joins the next one
                lost.call("push 2", "pushed")
            os.kill(lost.process.pid, signal.SIGSTOP if paused else signal.SIGKILL)
            wait_until(lambda: 1 not in _holders(cluster.addresses[0]), "rank 1 freed", timeout=lease + WAIT)
            started.append(DrivenWorker(cluster, 1))
            replacement = started[-1]
            if paused:  # wakes up and pushes: refused, merged nowhere
                lost.send("push 100")
                os.kill(lost.process.pid, signal.SIGCONT)
                answer = lost.expect()
                if answer == "pushed":  # sent without waiting for its answer: the next call raises the refusal
                    answer = lost.call("pull")
                assert answer.startswith("error FailedPreconditionError: "), answer
            if lost_pushed:  # round rounds+1 completes with the survivor's push
                survivor.call("push 1", "pushed")
                assert survivor.call("pull") == f"value {3 * (rounds := rounds + 1)}"
            for _ in range(rng.randint(1, 3)):
                _round(survivor, replacement, rounds := rounds + 1)
            assert survivor.close() == 0 and replacement.close() == 0
        finally:
            for worker in started:
                worker.stop()


def _round(rank0, rank1, number):
    """Rank 0 pushes 1, rank 1 pushes 2, both pull: 3 x ``number`` exactly."""
    rank0.call("push 1", "pushed")
    rank1.call("push 2", "pushed")
    assert rank0.call("pull") == rank1.call("pull") == f"value {3 * number}"
