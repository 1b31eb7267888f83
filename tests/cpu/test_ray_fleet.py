"""RolloutFleet on a local Ray cluster (CPU, the tiny model in fp32): routing and affinity, every fleet-wide call,
weights through one process group to every replica, a replica killed mid-rollout, a replica that never answers."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

ray = pytest.importorskip("ray")

from safetensors.torch import load_file  # noqa: E402

from torpor import LLM, SamplingParams  # noqa: E402
from torpor.rl.engine_process import free_port  # noqa: E402
from torpor.synthetic import make_model  # noqa: E402

ENGINE = {"dtype": "float32", "num_kv_blocks": 256, "max_model_len": 160, "enforce_eager": True}
GREEDY = SamplingParams(temperature=0, max_tokens=12)
PROMPTS = [[11 + i, 7, 3 * i + 1, 5, 9] for i in range(8)]


def wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"{what} within {timeout} s")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("ray-fleet")
    return tuple(str(make_model("tiny", root / name, seed=seed, dtype="float32", progress=False))
                 for name, seed in (("base", 0), ("pushed", 1), ("later", 2)))


@pytest.fixture(scope="module")
def cluster():
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def fleet(cluster, models):
    from torpor.ray import RolloutFleet

    fleet = RolloutFleet(models[0], num_replicas=2, device="cpu", engine_kwargs=ENGINE, max_restarts=2,
                         hang_timeout=2.0, call_timeout=60.0, generate_timeout=120.0)
    yield fleet
    fleet.shutdown()


@pytest.fixture(scope="module")
def reference(models):
    """Engines in this process on the base and on the pushed checkpoint: what undisturbed answers are."""
    base, pushed = LLM(models[0], device="cpu", **ENGINE), LLM(models[1], device="cpu", **ENGINE)
    yield base, pushed
    base.close()
    pushed.close()


def tokens(outputs) -> list[list[int]]:
    return [[list(c.token_ids) for c in o.outputs] for o in outputs]


def served(fleet) -> list[int]:
    return [row["served"] for row in fleet.stats()]


def test_routing_spreads_work_and_keeps_groups_together(fleet, reference):
    before = served(fleet)
    outputs = fleet.generate(PROMPTS, GREEDY)
    assert tokens(outputs) == tokens(reference[0].generate(PROMPTS, GREEDY))  # order kept
    assert [a - b for a, b in zip(served(fleet), before, strict=True)] == [4, 4]  # least outstanding work

    before = served(fleet)
    group = [[42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, i] for i in range(6)]
    first = fleet.generate(group, GREEDY, group_ids=["g"] * 6)
    delta = [a - b for a, b in zip(served(fleet), before, strict=True)]
    assert sorted(delta) == [0, 6], delta  # one replica took the whole group
    again = fleet.generate(group[:2], GREEDY, group_ids=["g", "g"])  # a later call: the same replica, its cache
    assert [a - b for a, b in zip(served(fleet), before, strict=True)] == [d + 2 * (d > 0) for d in delta]
    assert all(o.num_cached_tokens >= 16 for o in again), [o.num_cached_tokens for o in again]
    assert tokens(again) == tokens(first[:2])

    before = served(fleet)
    sampled = fleet.generate([PROMPTS[0], PROMPTS[1]], SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=6))
    assert [len(o.outputs) for o in sampled] == [4, 4]  # the n samples of a prompt: one request, one replica
    assert [a - b for a, b in zip(served(fleet), before, strict=True)] == [1, 1]

    with pytest.raises(ValueError, match="group_ids must be a list with one entry per prompt"):
        fleet.generate(PROMPTS, GREEDY, group_ids=["a"])
    from torpor.ray import FleetError

    with pytest.raises(FleetError, match=r"replica \d: ValueError"):  # the replica's own refusal, named
        fleet.generate([[10**9]], GREEDY)


def test_every_fleet_wide_call(fleet, reference):
    import asyncio

    expected = tokens(reference[0].generate(PROMPTS, GREEDY))
    reports = fleet.sleep(1)
    assert len(reports) == 2 and not reports.excluded and all(r is not None for r in reports)
    assert fleet.is_sleeping()
    with pytest.raises(RuntimeError, match=r"the fleet sleeps \(level 1\).*wake_up"):
        fleet.generate(PROMPTS, GREEDY)
    woken = fleet.wake_up(["weights"])
    assert [w.serving for w in woken] == [False, False]
    assert [w.serving for w in fleet.wake_up(["kv_cache"])] == [True, True]
    assert not fleet.is_sleeping()
    assert tokens(asyncio.run(fleet.generate_async(PROMPTS, GREEDY))) == expected  # bit-identical after the wake
    assert list(fleet.reset_prefix_cache()) == [True, True]
    assert list(fleet.collective_rpc("is_sleeping")) == [[False], [False]]
    usage = fleet.collective_rpc("memory_usage")
    assert all(u[0]["tags"]["weights"]["state"] == "awake" for u in usage)
    version = fleet.weight_version
    assert list(fleet.reload_weights()) == [None, None]
    assert fleet.weight_version == version + 1
    assert tokens(fleet.generate(PROMPTS, GREEDY)) == expected
    rows = fleet.stats()
    assert [r["state"] for r in rows] == ["serving", "serving"]
    assert all({"num_running", "num_waiting", "kv_cache_resident_bytes", "served", "in_flight"} <= r.keys()
               for r in rows)
    from torpor.ray import FleetError

    with pytest.raises(FleetError, match=r"collective_rpc failed on 2 replica\(s\): replica 0: .*replica 1: "):
        fleet.collective_rpc("no_such_method")


def test_pause_abort_by_id_and_the_weights_label(fleet, reference):
    """A paused fleet holds what is sent meanwhile (no raise), aborts by id, runs the rest after the resume as
    undisturbed; a replica restarted during the pause starts paused; the label reaches the outputs' tokens."""
    from torpor.engine.outputs import WeightVersionSpan

    prompts = PROMPTS[:4]
    ids = [f"p{i}" for i in range(4)]
    expected = tokens(reference[0].generate(prompts, GREEDY))
    fleet.pause_generation("abort")
    assert fleet.is_paused() and all(ray.get([r.is_paused.remote() for r in fleet.replicas]))
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(out=fleet.generate(prompts, GREEDY, request_ids=ids)))
    worker.start()
    wait_for(lambda: sum(r["num_waiting"] for r in fleet.stats()) == 4, 30, "the held requests were not queued")
    before = served(fleet)
    time.sleep(0.3)
    assert worker.is_alive() and served(fleet) == before  # held, not refused
    with pytest.raises(ValueError, match="request_ids must be 2 distinct"):
        fleet.generate(prompts[:2], GREEDY, request_ids=["same", "same"])
    assert sum(fleet.abort_requests(["p0", "p2", "nobody"])) == 2
    fleet.resume_generation()
    worker.join(timeout=60)
    out = result["out"]
    assert [o.outputs[0].finish_reason for o in out] == ["abort", "length", "abort", "length"]
    assert [o.outputs[0].token_ids for o in out[1::2]] == [e[0] for e in expected[1::2]]
    assert not fleet.is_paused()

    fleet.pause_generation("keep")
    os.kill(ray.get(fleet.replicas[0].info.remote())["pid"], signal.SIGKILL)  # (replica 1 dies later on)
    wait_for(lambda: fleet.stats()[0]["state"] != "serving", 10, "the death was not seen")
    wait_for(lambda: fleet.stats()[0]["state"] == "serving", 90, "replica 0 did not come back")
    assert ray.get(fleet.replicas[0].is_paused.remote())  # restarted into the fleet's pause
    fleet.resume_generation()
    assert not any(ray.get([r.is_paused.remote() for r in fleet.replicas]))

    label = fleet.weight_version + 100
    assert len(fleet.update_weight_version(label)) == 2
    assert fleet.get_weight_version() == label and [r["weight_version"] for r in fleet.stats()] == [label, label]
    out = fleet.generate(prompts, GREEDY)
    assert tokens(out) == expected  # the weights untouched
    assert all(o.outputs[0].weight_versions == [WeightVersionSpan(str(label), 0, 12)] for o in out)


def push(fleet, path: str, group_name: str, keep: bool) -> list[tuple]:
    """The checkpoint at `path` broadcast by this process (rank 0 of a new gloo group) to every replica; `keep`:
    hand the fleet a copy for restarts (`source=`)."""
    from torpor.ray import GroupBroadcaster, spec

    named = list(load_file(os.path.join(path, "model.safetensors")).items())
    port, world = free_port(), fleet.group_world_size()
    trainer = GroupBroadcaster("127.0.0.1", port, world_size=world, group_name=group_name, timeout=60)
    opened = threading.Thread(target=trainer.open)  # rank 0 hosts the store while the replicas join
    opened.start()
    fleet.init_weights_update_group("127.0.0.1", port, 1, world, group_name, "gloo")
    opened.join(timeout=60)
    assert trainer.group is not None
    try:
        sent = threading.Thread(target=trainer.broadcast, args=(named,))
        sent.start()  # the trainer broadcasts while every replica receives, at once
        counts = fleet.update_weights_from_distributed(*spec(named), group_name=group_name,
                                                       source=ray.put(named) if keep else None)
        sent.join(timeout=60)
    finally:
        fleet.destroy_weights_update_group(group_name)
        trainer.close()
    assert list(counts) == [len(named)] * len(counts)
    return named


def test_weights_through_one_group_to_every_replica(fleet, reference, models):
    push(fleet, models[1], "fleet-test", keep=True)
    version = fleet.weight_version
    assert [r["weight_version"] for r in fleet.stats()] == [version, version]
    before = served(fleet)
    assert tokens(fleet.generate(PROMPTS, GREEDY)) == tokens(reference[1].generate(PROMPTS, GREEDY))
    assert all(a > b for a, b in zip(served(fleet), before, strict=True))  # both replicas answered


def test_replica_killed_mid_rollout(fleet, reference):
    """Nothing lost: the dead replica's prompts are answered by the other, greedy answers as undisturbed; the
    restarted replica serves again only with the fleet's current (pushed) weights."""
    prompts = [[5 + i, 6, 7, 8, 9, 10] for i in range(12)]
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    expected = tokens(reference[1].generate(prompts, params))
    # (a replica a health check found slow on a loaded machine gets no prompts until it answers again)
    wait_for(lambda: all(r["state"] == "serving" for r in fleet.stats()), 60, "both replicas serving")
    restarts = [r["restarts"] for r in fleet.stats()]
    pids = [ray.get(r.info.remote())["pid"] for r in fleet.replicas]
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(out=fleet.generate(prompts, params, timeout=120)))
    worker.start()
    busy = wait_for(lambda: [i for i in (1, 0) if ray.get(fleet.replicas[i].stats.remote())["in_flight"] > 0], 30,
                    "no replica got prompts")
    victim = busy[0]
    os.kill(pids[victim], signal.SIGKILL)
    detected = time.monotonic()
    wait_for(lambda: fleet.stats()[victim]["state"] != "serving", 10, "the death was not seen")
    assert time.monotonic() - detected < 5
    during = fleet.reset_prefix_cache(timeout=90)  # a fleet call during the restart waits for it, includes it
    assert not during.excluded and len(during) == 2 and during[victim] is not None
    worker.join(timeout=120)
    assert tokens(result["out"]) == expected  # every prompt answered, as undisturbed

    wait_for(lambda: fleet.stats()[victim]["state"] == "serving", 90, f"replica {victim} did not come back")
    rows = fleet.stats()
    assert rows[victim]["restarts"] == restarts[victim] + 1 and rows[victim]["weight_version"] == fleet.weight_version
    assert ray.get(fleet.replicas[victim].info.remote())["pid"] != pids[victim]
    before = served(fleet)
    assert tokens(fleet.generate(PROMPTS, GREEDY)) == tokens(reference[1].generate(PROMPTS, GREEDY))
    assert served(fleet)[victim] > before[victim]  # the new replica answered, with the pushed weights


def test_replica_that_never_answers_is_named(fleet, reference):
    from torpor.ray import FleetTimeoutError

    pid = ray.get(fleet.replicas[0].info.remote())["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        named = r"reset_prefix_cache failed on 1 replica\(s\): replica 0: ReplicaTimeout: no answer .* within 3 s"
        with pytest.raises(FleetTimeoutError, match=named) as failure:
            fleet.reset_prefix_cache(timeout=3)
        assert time.monotonic() - start < 6 and set(failure.value.errors) == {0}
        assert failure.value.results[1] is True  # the other replica answered
        wait_for(lambda: fleet.stats(timeout=1)[0]["state"] == "unresponsive", 10, "not marked unresponsive")
        expected = tokens(reference[1].generate(PROMPTS[:3], GREEDY))
        assert tokens(fleet.generate(PROMPTS[:3], GREEDY, timeout=30)) == expected  # routed around it
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_for(lambda: fleet.stats()[0]["state"] == "serving", 20, "replica 0 did not answer again")


def test_restart_without_kept_weights_waits_for_the_next_update(fleet, models):
    """A replica restarted after an update whose weights the fleet did not keep never serves the checkpoint's:
    it stays stale, a group formed before its restart refuses to run without it, and the next update (over a
    group formed anew) brings it back."""
    from torpor.ray import FleetError, GroupBroadcaster, spec

    later = LLM(models[2], device="cpu", **ENGINE)
    expected = tokens(later.generate(PROMPTS, GREEDY))
    later.close()
    named = push(fleet, models[2], "unkept", keep=False)
    port = free_port()
    trainer = GroupBroadcaster("127.0.0.1", port, world_size=3, group_name="before", timeout=60)
    opened = threading.Thread(target=trainer.open)
    opened.start()
    fleet.init_weights_update_group("127.0.0.1", port, 1, 3, "before", "gloo")
    opened.join(timeout=60)

    os.kill(ray.get(fleet.replicas[1].info.remote())["pid"], signal.SIGKILL)
    wait_for(lambda: fleet.stats()[1]["state"] == "stale", 60, "replica 1 did not come back stale")
    assert "were not kept" in fleet.stats()[1]["last_error"]
    before = served(fleet)
    assert tokens(fleet.generate(PROMPTS, GREEDY)) == expected  # only replica 0 (the current weights) answers
    assert served(fleet)[1] == before[1]
    with pytest.raises(FleetError, match=r"replica 1: RuntimeError: not in weights update group 'before'"):
        fleet.update_weights_from_distributed(*spec(named), group_name="before")  # refused before any broadcast
    fleet.destroy_weights_update_group("before")
    trainer.close()

    push(fleet, models[2], "again", keep=False)  # the next update reaches every replica: all serve again
    assert [r["state"] for r in fleet.stats()] == ["serving", "serving"]
    before = served(fleet)
    assert tokens(fleet.generate(PROMPTS, GREEDY)) == expected
    assert served(fleet)[1] > before[1]


def test_importing_torpor_does_not_import_ray():
    import subprocess
    import sys

    code = "import sys, torpor, torpor.engine.llm, torpor.rl; assert 'ray' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
