"""Short, complete programs as users write them, each run to its end (or cancelled, or broken out
of), with the data checked: the training loop with weight updates for every delivery mode,
prefetch and backend; updates before the first batch, after a break, from another task, at once
from two tasks; a collector forgotten in a notebook cell; a collector used from a second event
loop; the blocking wrapper inside an event loop; plain scripts that never close their collector;
and the same programs on trio; an evaluator used as a training script uses it."""

from __future__ import annotations

import asyncio
import copy
import gc
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest
import torch

from aiocollect import AiocollectError, Collector, CollectorClosedError, ConfigError, State
from aiocollect._collector.weightsync import WeightSync
from procs import alive, ctrl_c, template_workers

SCRIPTS = Path(__file__).resolve().parent / "scripts"


class Greedy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))

    def forward(self, observation):
        return self.net(observation).argmax(-1)


def train(policy: torch.nn.Module) -> None:
    """What a trainer does between batches: the weights change."""
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.01)


def check_batch(batch) -> None:
    """CartPole's dynamics: the `next` observation of frame t is the observation of frame t+1
    unless the episode ended at t; a batch from one worker has one policy version per env row."""
    obs, nxt, done = batch["observation"], batch["next", "observation"], batch["next", "done"][..., 0]
    broken = ~(nxt[:, :-1] == obs[:, 1:]).all(-1) & ~done[:, :-1]
    assert not bool(broken.any()), f"{int(broken.sum())} frames break continuity"
    versions = batch["collector", "policy_version"]
    assert bool((versions == versions[:, :1]).all()), "a worker's batch mixes weight versions"


# ---- the training loop ------------------------------------------------------------------------

@pytest.mark.parametrize("num_workers", [0, 2], ids=["local", "process"])
@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("delivery", ["sync", "async"])
async def test_training_loop_with_weight_updates_runs_to_its_natural_end(delivery, prefetch, num_workers):
    """`async for batch in c: train(batch); await c.update_weights(policy)` with a finite
    total_frames ends cleanly after exactly total_frames // frames_per_batch batches, whatever
    the delivery mode, prefetch and backend; the data obey CartPole's dynamics; the versions
    each worker's frames carry never go back and some carry an update; after the end an update
    returns a new version without waiting, and after aclose() it raises CollectorClosedError.
    Async workers each run up to prefetch + 1 batches ahead (at least two), the worker of each
    batch taken (the first one, and `prefetch` assembled ahead) one more: on a loaded machine all
    of them may be started before the first update, and the next one delivered is started after
    it (so carries it)."""
    policy = Greedy()
    batches, versions = 0, {}
    seats = max(num_workers, 1)
    total_envs = 2 * seats
    ahead = seats * max(2, prefetch + 1) + 1 + prefetch  # batches that may all be version 0
    total = 6 if delivery == "sync" else ahead + 1
    with anyio.fail_after(60):
        async with Collector("CartPole-v1", policy, frames_per_batch=256, total_frames=256 * total, num_workers=num_workers,
                             envs_per_worker=2, delivery=delivery, prefetch=prefetch) as c:
            async for batch in c:
                check_batch(batch)
                batches += 1
                workers = batch["collector", "traj_ids"][:, 0] % total_envs // 2  # ids encode the global env
                for w, v in zip(workers.tolist(), batch["collector", "policy_version"][:, 0].tolist()):
                    versions.setdefault(w, []).append(v)
                train(policy)
                version = await c.update_weights(policy)
                assert version == batches
            assert c.state is State.STOPPED
            assert await c.update_weights(policy) == batches + 1  # the workers are done: nothing to wait for
    assert batches == total
    assert all(v == sorted(v) for v in versions.values()), versions
    assert max(max(v) for v in versions.values()) >= 1, versions
    with pytest.raises(CollectorClosedError):
        await c.update_weights(policy)


@pytest.mark.parametrize("prefetch", [0, 2])
async def test_async_workers_run_ahead_by_their_slots_to_fill_not_more(prefetch):
    """`delivery="async"` is off-policy, but boundedly: each worker runs at most prefetch + 1
    batches (at least two) ahead of what was taken, not into the slots kept for lending, and
    `prefetch` batches are assembled ahead. However long the trainer takes, after an update at
    most those batches still carry the weights before it (TorchRL's MultiaSyncDataCollector: one
    per worker)."""
    policy = Greedy()
    workers, ahead = 2, max(2, prefetch + 1)
    with anyio.fail_after(60):
        async with Collector("CartPole-v1", policy, frames_per_batch=64, num_workers=workers, envs_per_worker=2,
                             delivery="async", prefetch=prefetch) as c:
            stale = 0
            async for batch in c:
                version = int(batch["collector", "policy_version"].min())
                if c.policy_version == 0:  # the first batch: a long training step, then an update
                    await anyio.sleep(0.5)  # (time for the workers to fill what they may)
                    train(policy)
                    assert await c.update_weights(policy) == 1
                elif version == 0:
                    stale += 1
                else:
                    break
            del batch  # (a lent batch: its memory goes back once nothing refers to it)
    assert stale <= workers * ahead + prefetch, stale


@pytest.mark.parametrize("inference", ["worker", "server"])
async def test_the_readme_loop_with_default_options_is_on_policy(inference):
    """The README's loop, `async for batch in collector: <train>; await
    collector.update_weights(policy)`, with the default options (sync delivery, no prefetch), as
    TorchRL's MultiSyncCollector: batch k is collected with the weights published just before it
    was asked for. Every frame of it carries version k, and its action is the one those weights
    choose (those of version k - 1 would choose otherwise for many frames: the check can fail)."""
    torch.manual_seed(0)
    policy = Greedy()
    published = [copy.deepcopy(policy)]  # the weights of each version
    stale = 0  # frames whose action version k - 1 would not have chosen
    with anyio.fail_after(90):
        async with Collector("CartPole-v1", policy, frames_per_batch=256, total_frames=256 * 5, num_workers=2,
                             envs_per_worker=2, inference=inference) as collector:
            async for batch in collector:
                k = len(published) - 1
                versions = batch["collector", "policy_version"]
                assert bool((versions == k).all()), f"batch {k} has versions {versions.unique().tolist()}"
                with torch.no_grad():
                    assert torch.equal(batch["action"], published[k](batch["observation"])), f"batch {k}"
                    if k:
                        stale += int((published[k - 1](batch["observation"]) != batch["action"]).sum())
                with torch.no_grad():  # training: new weights, which choose other actions
                    for p in policy.parameters():
                        p.add_(torch.randn_like(p))
                assert await collector.update_weights(policy) == k + 1
                published.append(copy.deepcopy(policy))
    assert len(published) == 6  # five batches, each followed by an update
    assert stale > 100, stale


@pytest.mark.parametrize("num_workers", [0, 1], ids=["local", "process"])
async def test_break_then_update_then_go_on_collecting(num_workers):
    """`break` out of `async for`, update, then iterate again: the update is applied (the
    frames soon carry its version) and collection goes on where it stopped."""
    policy = Greedy()
    with anyio.fail_after(60):
        async with Collector("CartPole-v1", policy, frames_per_batch=64, num_workers=num_workers, envs_per_worker=2) as c:
            async for batch in c:
                break
            train(policy)
            assert await c.update_weights(policy) == 1
            async for batch in c:
                check_batch(batch)
                if int(batch["collector", "policy_version"].min()) == 1:
                    break


async def test_update_before_the_first_batch_starts_the_collector_and_every_later_frame_has_it():
    """An update before `async with` (or before the first batch) starts the collector and waits
    until every worker applied it: every frame collected after that carries it."""
    policy = Greedy()
    c = Collector("CartPole-v1", policy, frames_per_batch=64, total_frames=64 * 6, num_workers=2,
                  envs_per_worker=2, prefetch=0)
    with anyio.fail_after(60):
        train(policy)
        assert await c.update_weights(policy) == 1
        assert c.state is State.RUNNING and c.worker_versions == (1, 1)
        async with c:
            batches = [b async for b in c]
    assert len(batches) == 6
    assert all(bool((b["collector", "policy_version"] == 1).all()) for b in batches)


@pytest.mark.parametrize("delivery", ["sync", "async"])
async def test_updates_from_a_trainer_task_while_another_task_consumes(delivery):
    """A trainer task publishes weights in a loop while the consumer task iterates to the end:
    neither fails nor hangs, and each worker's versions never go back."""
    policy = Greedy()
    seen: dict[int, list[int]] = {}
    done = anyio.Event()

    async def trainer(c: Collector) -> None:
        while not done.is_set():
            train(policy)
            await c.update_weights(policy)
            await anyio.sleep(0.005)

    with anyio.fail_after(60):
        async with Collector("CartPole-v1", policy, frames_per_batch=128, total_frames=128 * 10, num_workers=2,
                             envs_per_worker=2, delivery=delivery) as c:
            async with anyio.create_task_group() as tg:
                tg.start_soon(trainer, c)
                async for batch in c:
                    check_batch(batch)
                    ids = batch["collector", "traj_ids"][:, 0] % 4  # traj ids encode the global env index
                    for env, version in zip(ids.tolist(), batch["collector", "policy_version"][:, 0].tolist()):
                        seen.setdefault(env, []).append(version)
                done.set()
    assert c.policy_version > 1
    for env, versions in seen.items():
        assert versions == sorted(versions), (env, versions)


async def test_two_tasks_updating_at_once_both_return_when_the_workers_applied():
    """Two tasks calling update_weights(wait=True) at the same moment both return once the
    workers applied their versions (neither loses its wake-up)."""
    policy = Greedy()
    with anyio.fail_after(30):
        async with Collector("CartPole-v1", policy, frames_per_batch=64, num_workers=2, envs_per_worker=2) as c:
            await c.collect()
            versions: list[int] = []

            async def update() -> None:
                versions.append(await c.update_weights(policy))

            for _ in range(5):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(update)
                    tg.start_soon(update)
                assert min(c.worker_versions) >= max(versions)
    assert sorted(versions) == list(range(1, 11))


async def test_every_waiter_wakes_at_one_acknowledgement():
    """The weight store's waiters share one wake-up: one acknowledgement wakes all of them at
    once (no waiter falls back to polling)."""

    class Seat:
        index = 0

    sync = WeightSync(None, True, lambda *a, **k: anyio.sleep(0), 1)
    sync.acked = [0]
    woken: list[int] = []

    async def waiter(k: int) -> None:
        assert await sync.wait_applied(1, [0], lambda: True)
        woken.append(k)

    async with anyio.create_task_group() as tg:
        for k in range(3):
            tg.start_soon(waiter, k)
        await anyio.wait_all_tasks_blocked()
        await sync.on_applied(Seat(), 1)
        await anyio.wait_all_tasks_blocked()
        assert sorted(woken) == [0, 1, 2]


# ---- collectors people forget, loops they mix -------------------------------------------------

async def test_a_forgotten_collector_is_stopped_with_a_resource_warning():
    """Re-running a notebook cell `c = Collector(...); await c.start()` leaves the previous
    collector unreachable: the garbage collector's finalizer stops its workers and warns."""
    pids = []
    with pytest.warns(ResourceWarning, match="was not closed"):
        for _ in range(3):
            c = Collector("CartPole-v1", frames_per_batch=64, num_workers=1)
            await c.start()
            pids.append(c.worker_pids[0])
        del c
        gc.collect()
    with anyio.fail_after(20):
        while any(alive(p) for p in pids):
            await anyio.sleep(0.02)


async def test_break_out_of_async_for_over_an_unnamed_collector_stops_it():
    """`async for batch in Collector(...): break` (no name, no close): the collector is stopped
    once it is garbage-collected, with a ResourceWarning."""
    with pytest.warns(ResourceWarning, match="was not closed"):
        async for batch in Collector("CartPole-v1", frames_per_batch=64, num_workers=1):
            check_batch(batch)
            break
        gc.collect()
    with anyio.fail_after(20):
        while any(alive(p) for p in _children()):
            await anyio.sleep(0.02)


def _children() -> list[int]:
    """The live workers forked by the launcher's templates."""
    from aiocollect._backends.launcher import get_launcher

    return template_workers(get_launcher().pid)


def test_a_collector_belongs_to_the_event_loop_that_started_it():
    """`asyncio.run(c.start())` then `asyncio.run(c.collect())`: the second loop gets an error
    that says why (the first loop ended and took the workers with it), not a false "all frames
    collected"; aclose() from the new loop is fine; no worker is left."""
    c = Collector("CartPole-v1", frames_per_batch=64, num_workers=1)
    asyncio.run(c.start())
    pid = c.worker_pids[0] if c.worker_pids else None
    with pytest.raises(CollectorClosedError, match="another event loop"):
        asyncio.run(c.collect())
    with pytest.raises(CollectorClosedError, match="another event loop"):
        asyncio.run(c.start())
    asyncio.run(c.aclose())
    assert c.state is State.CLOSED
    assert pid is None or not alive(pid)


async def test_the_blocking_wrapper_refuses_to_freeze_a_running_event_loop():
    """`for batch in c` or `with c:` inside a coroutine would block the loop: a clear error
    pointing at `async for` instead, and nothing is started."""
    c = Collector("CartPole-v1", frames_per_batch=64, num_workers=1)
    with pytest.raises(AiocollectError, match="async for"):
        for _ in c:
            pass  # pragma: no cover
    with pytest.raises(AiocollectError, match="async with"):
        with c:
            pass  # pragma: no cover
    assert c.state is State.CREATED
    await c.aclose()


@pytest.mark.parametrize("inference", ["worker", "server"])
def test_blocking_training_loop_with_update_policy_weights_to_its_natural_end(inference):
    """The TorchRL-style blocking script: `with Collector(...) as c: for batch in c: train;
    c.update_policy_weights_(policy)` runs to total_frames; each update is a new version that the
    next batches carry (prefetch=0: each batch collected after the previous update), and the
    frames follow CartPole's dynamics."""
    torch.manual_seed(0)
    policy = Greedy()
    versions = []
    with Collector("CartPole-v1", policy, frames_per_batch=64, total_frames=64 * 4, num_workers=2,
                   envs_per_worker=2, prefetch=0, inference=inference, seed=0) as c:
        for batch in c:
            check_batch(batch)
            versions.append(int(batch["collector", "policy_version"].max()))
            train(policy)
            assert c.update_policy_weights_(policy) == len(versions)
    assert versions == [0, 1, 2, 3]


def test_a_torch_dataloader_iterates_the_collector():
    """`DataLoader(collector, batch_size=None, collate_fn=lambda b: b)`: the collector is an
    IterableDataset, each item one of its batches (total_frames in all), and it closes at the end.
    (DataLoader's default collate takes a TensorDict for a mapping and indexes it by its own
    rows: hand batches through as they are.)"""
    from torch.utils.data import DataLoader

    c = Collector("CartPole-v1", frames_per_batch=32, total_frames=32 * 3, num_workers=1, envs_per_worker=2, seed=0)
    batches = list(DataLoader(c, batch_size=None, collate_fn=lambda b: b))
    assert [b.batch_size for b in batches] == [torch.Size([2, 16])] * 3
    for b in batches:
        check_batch(b)
    assert c.state is State.CLOSED


async def test_update_policy_weights_inside_an_event_loop_says_to_await_update_weights():
    c = Collector("CartPole-v1", Greedy(), frames_per_batch=64, num_workers=1)
    with pytest.raises(AiocollectError, match="update_policy_weights_"):
        c.update_policy_weights_()
    await c.aclose()


@pytest.mark.parametrize("mode", ["end", "break", "raise", "endless_break"])
def test_plain_script_that_never_closes_its_collector_exits(mode):
    """A script with `for batch in Collector(...)` and no `with`/`close()` exits promptly
    whether the loop ends, is broken out of, or raises, and leaves no worker behind."""
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "plain_for.py"), mode], capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == (1 if mode == "raise" else 0), proc.stderr
    lines = proc.stdout.split()
    assert lines[0] == "pids", proc.stdout
    pids = [int(p) for p in lines[1:]]
    assert pids and not any(alive(p) for p in pids)
    assert "Traceback" not in proc.stderr or mode == "raise", proc.stderr
    assert time.monotonic() - t0 < 55


@pytest.mark.timeout(150)
def test_ctrl_c_in_a_terminal_stops_the_script_not_its_workers_and_leaves_nothing():
    """A training script (collector and evaluator) run as a terminal's foreground job and stopped
    with Ctrl-C, which the terminal sends to the whole foreground process group: the script's
    KeyboardInterrupt closes both cleanly (the workers, in a session of their own, are stopped by
    their collector, not killed by the signal mid-batch); neither the script's session nor any
    worker is left afterwards. The evaluator's worker with `nice=5` is a session of its own at niceness 5 (Linux's
    autogroups weigh sessions, and apply `nice` only within one): below the training loop too."""
    from test_cli import in_session

    with subprocess.Popen(
        [sys.executable, str(SCRIPTS / "ctrl_c.py")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,  # as a shell starts a job: its own session and group
    ) as proc:  # fmt: skip
        try:
            lines = []
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.append(line.split())
                if lines[-1] == ["collecting"]:
                    break
            if lines[-1:] != [["collecting"]]:
                pytest.fail(f"the script did not start collecting: {lines}\n{proc.communicate(timeout=30)[1]}")
            time.sleep(0.5)  # collecting and updating
            out, err = ctrl_c(proc)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    me = next(line for line in lines if line[0] == "me")
    sid, pgid = int(me[2]), int(me[3])
    workers = [[int(x) for x in line[1:5]] + line[5:] for line in lines if line[0] == "worker"]
    assert len(workers) == 3, lines
    collectors, evaluator = workers[:2], workers[2]
    assert all(w[1] != sid and w[2] != pgid for w in workers), (workers, sid, pgid)  # no terminal signal
    assert collectors[0][1] == collectors[1][1] != evaluator[1], workers  # the evaluator's own session
    assert [w[3] for w in workers] == [0, 0, 5], workers  # its nice=5
    if evaluator[4] != "-":  # (a kernel with autogroups)
        assert [w[4] for w in workers] == ["0", "0", "5"], workers
    assert proc.returncode == 130, (out, err)
    assert out.splitlines()[-1] == "interrupted", out
    batches, continuity = out.split()[-4], out.split()[-2]
    assert int(batches) >= 1 and continuity == "True", out
    assert "Error" not in err and "Traceback" not in err, err  # no BrokenWorkerError: nothing died mid-batch
    deadline = time.monotonic() + 5
    while in_session(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not in_session(proc.pid)
    assert not any(alive(w[0]) for w in workers)


def test_collector_refuses_other_platforms_at_construction(monkeypatch):
    """aiocollect needs Linux: elsewhere, constructing a collector with worker processes (or an
    evaluator) raises ConfigError saying so, before anything starts."""
    from aiocollect import Evaluator

    monkeypatch.setattr(sys, "platform", "darwin")
    with pytest.raises(ConfigError, match="needs Linux"):
        Collector("CartPole-v1", frames_per_batch=64, num_workers=1)
    with pytest.raises(ConfigError, match="needs Linux"):
        Evaluator("CartPole-v1")


# ---- the evaluator -----------------------------------------------------------------------------

async def test_evaluator_program_evaluates_triggers_polls_and_closes_leaving_no_process():
    """A real CartPole evaluator in its own worker process: two evaluations of the same weights
    give the same episodes (seeded), triggered ones arrive through wait() and poll(), every
    result is a dict of Python numbers tagged with its step, and closing leaves no process."""
    from aiocollect import Evaluator, EvaluatorState
    from aiocollect.events import EvaluationCompleted

    policy = Greedy()
    keys = {"return_mean", "return_std", "return_min", "return_max", "episode_length_mean", "step",
            "num_trajectories", "seconds"}
    async with Evaluator("CartPole-v1", policy, num_trajectories=3, num_envs=2, seed=0) as ev:
        first = await ev.evaluate(policy, step=0)
        again = await ev.evaluate(policy, step=1)
        pid = ev.worker_pid
        train(policy)
        assert ev.trigger(policy, step=2)
        waited = await ev.wait()
        assert ev.trigger(policy, step=3) and ev.pending == 1
        await ev.wait_for(EvaluationCompleted, lambda e: e.step == 3)
        polled = ev.poll()
        assert ev.poll() is None and ev.pending == 0
    results = [first, again, waited, polled]
    assert [r["step"] for r in results] == [0, 1, 2, 3]
    for r in results:
        assert set(r) == keys and r["num_trajectories"] == 3
        assert all(type(v) in (int, float) for k, v in r.items() if k != "step")
        assert 1 <= r["return_min"] <= r["return_mean"] <= r["return_max"] <= 500
        assert r["return_mean"] == r["episode_length_mean"], "CartPole: a reward of 1 per step"
    assert {k: v for k, v in first.items() if k not in ("step", "seconds")} == \
        {k: v for k, v in again.items() if k not in ("step", "seconds")}
    assert ev.state is EvaluatorState.CLOSED and ev.completed == 4 and ev.worker_pid is None
    assert pid is not None and not alive(pid)


# ---- trio ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("num_workers", [0, 2], ids=["local", "process"])
def test_training_loop_on_trio(num_workers):
    """The training loop, and a cancelled `async with` entry, on trio (through anyio)."""
    pytest.importorskip("trio")
    policy = Greedy()

    async def main() -> int:
        n = 0
        async with Collector("CartPole-v1", policy, frames_per_batch=128, total_frames=128 * 4,
                             num_workers=num_workers, envs_per_worker=2, delivery="async") as c:
            async for batch in c:
                check_batch(batch)
                n += 1
                train(policy)
                await c.update_weights(policy)
        c2 = Collector("CartPole-v1", policy, frames_per_batch=128, num_workers=num_workers)
        with anyio.move_on_after(0.05):
            async with c2:
                await anyio.sleep(10)  # pragma: no cover
        assert c2.state is State.CLOSED
        return n

    assert anyio.run(main, backend="trio") == 4


def test_weight_updates_cancellations_and_forgotten_collectors_on_trio():
    """On trio: two tasks updating at once both return; `async with` cancelled at assorted
    moments (entry included) leaves no worker, fd or mapping; a forgotten collector is stopped
    by its finalizer."""
    pytest.importorskip("trio")
    import os
    import random

    policy = Greedy()

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    async def main() -> None:
        async with Collector("CartPole-v1", policy, frames_per_batch=64, num_workers=2, envs_per_worker=2) as c:
            await c.collect()
            versions: list[int] = []

            async def update() -> None:
                versions.append(await c.update_weights(policy))

            async with anyio.create_task_group() as tg:
                tg.start_soon(update)
                tg.start_soon(update)
            assert sorted(versions) == [1, 2] and min(c.worker_versions) == 2
        rng = random.Random(0)
        before = fds()
        for _ in range(8):
            with anyio.move_on_after(rng.uniform(0, 0.3)):
                async with Collector("CartPole-v1", frames_per_batch=64, num_workers=2) as c:
                    async for batch in c:
                        del batch  # (a lent batch kept after the close would keep its slot mapped)
            assert c.state is State.CLOSED
        assert fds() == before and not _children()
        with pytest.warns(ResourceWarning, match="was not closed"):
            forgotten = Collector("CartPole-v1", frames_per_batch=64, num_workers=1)
            await forgotten.start()
            pid = forgotten.worker_pids[0]
            del forgotten
            gc.collect()
        with anyio.fail_after(20):
            while alive(pid):
                await anyio.sleep(0.02)

    anyio.run(main, backend="trio")


@pytest.mark.parametrize("prefetch", [0, 2])
async def test_async_delivery_training_loop_never_deadlocks_over_many_runs(prefetch):
    """The loop that deadlocked in 8 of 20 runs (async delivery, 2 workers x 4 CartPole envs,
    256 frames per batch, an update after each batch): 10 runs, each to its end."""
    policy = Greedy()
    for _ in range(10):
        with anyio.fail_after(30):
            async with Collector("CartPole-v1", policy, frames_per_batch=256, total_frames=256 * 8, num_workers=2,
                                 envs_per_worker=4, delivery="async", prefetch=prefetch) as c:
                n = 0
                async for batch in c:
                    n += 1
                    train(policy)
                    await c.update_weights(policy)
        assert n == 8
