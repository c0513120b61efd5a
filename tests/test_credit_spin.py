"""A sync worker process with a CPU of its own looks for its next credit for up to a millisecond
before it sleeps (``pool.credit_spin``): a credit read as it comes costs no wake-up. Where it is
decided (the CPUs of the collector's process, ``worker_cpus``, the delivery, server inference),
what the look does with a message, a quiet socket and a closed one, and the README's loop with the
policy trained in place on such a worker, every frame checked. No timing is asserted."""

from __future__ import annotations

import os
import socket
import threading

import anyio
import pytest
import torch
from tensordict.nn import TensorDictModule

from aiocollect import Collector, CollectorConfig
from aiocollect._collector.pool import CREDIT_SPIN, credit_spin
from aiocollect._core import wire
from aiocollect._worker.peer import Peer, _Stop

from test_in_place_training import Net, train_step, wrong_frames
from test_user_programs import Greedy, check_batch

ALLOWED = sorted(os.sched_getaffinity(0))


def config(workers: int, **options) -> CollectorConfig:
    return CollectorConfig("CartPole-v1", Greedy(), frames_per_batch=4 * workers, num_workers=workers,
                           envs_per_worker=4, **options)


def test_a_worker_looks_for_its_credit_only_where_it_and_the_collector_have_cpus_of_their_own(monkeypatch):
    """Sync delivery, as many CPUs as workers + 1: the workers look (``CREDIT_SPIN``); fewer: they
    sleep at once. ``worker_cpus`` decides instead where given: no CPU shared by two workers, and
    one left to none. Never under server inference (its thread needs a CPU) nor async delivery
    (a worker waiting for a credit there is ahead: nothing waits on it)."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert CREDIT_SPIN > 0
    assert [credit_spin(config(w)) for w in (1, 2, 3, 4, 8)] == [CREDIT_SPIN] * 3 + [0.0] * 2
    assert credit_spin(config(1, inference="server")) == 0.0
    assert credit_spin(config(1, delivery="async")) == 0.0
    assert credit_spin(config(2, worker_cpus=[[0], [1]])) == CREDIT_SPIN
    assert credit_spin(config(2, worker_cpus=[[0, 1], [2]])) == CREDIT_SPIN
    assert credit_spin(config(2, worker_cpus=[[0, 1], [1, 2]])) == 0.0  # (CPU 1 shared)
    assert credit_spin(config(2, worker_cpus=[0, 1])) == 0.0  # (one set for every worker: shared)
    assert credit_spin(config(2, worker_cpus=[[0, 1], [2, 3]])) == 0.0  # (none left to the collector)


class _Quiet(Peer):
    def handle(self, msg, fds) -> None:  # pragma: no cover - not called here
        raise AssertionError(msg)


@pytest.mark.timeout(60)
def test_the_look_returns_at_a_message_at_a_closed_socket_and_when_its_time_is_up():
    """A message sent while the peer looks ends the look (given a minute, it must not take it) and
    is read whole; a quiet socket ends it when its time is up, with nothing read; a closed one
    ends it and the next receive stops the peer."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    peer = _Quiet(ours)
    try:
        peer.look(0.005)
        assert not wire.message_waiting(ours)
        sender = threading.Timer(0.05, wire.send_blocking, (theirs, wire.Credit(3)))
        sender.start()
        peer.look(60.0)
        sender.join()
        assert wire.message_waiting(ours)
        assert peer.recv() == (wire.Credit(3), [])
        theirs.close()
        peer.look(60.0)
        with pytest.raises(_Stop):
            peer.recv()
    finally:
        ours.close()
        theirs.close()


@pytest.mark.timeout(300)
@pytest.mark.loops("asyncio")
@pytest.mark.skipif(len(ALLOWED) < 2, reason="a worker looks for its credit only with a CPU of its own")
@pytest.mark.parametrize("delivery", ["sync", "async"])
async def test_the_readme_loop_trained_in_place_on_a_looking_worker_holds_every_frame(delivery):
    """One worker (which looks for its credits on this machine in sync), default options: after each batch
    an optimizer step on the constructor's policy, then ``update_weights``. Every frame acts with
    the weights its version names, the physics run on across batches, and in sync delivery every
    frame of batch n carries version n (on-policy)."""
    torch.manual_seed(0)
    module = Net()
    policy = TensorDictModule(module, in_keys=["observation"], out_keys=["action", "logits"])
    optimizer = torch.optim.SGD(module.parameters(), lr=0.5)
    snapshots = {0: {k: v.detach().clone() for k, v in module.state_dict().items()}}
    reference = Net()
    frames_per_batch, batches = 4 * 8, 30
    assert credit_spin(config(1, delivery=delivery)) == (CREDIT_SPIN if delivery == "sync" else 0.0)
    wrong = i = 0
    last_obs = last_done = None
    with anyio.fail_after(240):
        async with Collector("CartPole-v1", policy, frames_per_batch=frames_per_batch,
                             total_frames=frames_per_batch * batches, num_workers=1, envs_per_worker=4, seed=0,
                             delivery=delivery) as c:
            async for batch in c:
                if i == 0:  # (what the worker was told)
                    told = [cfg.credit_spin for cfg in c._run.shared.pool.configs]
                    assert told == [credit_spin(config(1, delivery=delivery))]
                check_batch(batch)
                wrong += wrong_frames(batch, reference, snapshots)
                versions = batch["collector", "policy_version"]
                if delivery == "sync":
                    assert bool((versions == i).all()), f"batch {i} carries versions {versions.unique().tolist()}"
                    if last_obs is not None:  # (the first frame follows the last one of the batch before)
                        assert bool((batch["observation"][:, 0] == last_obs).all(-1)[~last_done].all())
                    last_obs = batch["next", "observation"][:, -1].clone()
                    last_done = batch["next", "done"][:, -1, 0].clone()
                train_step(module, optimizer, batch)
                version = await c.update_weights(policy)
                snapshots[version] = {k: v.detach().clone() for k, v in module.state_dict().items()}
                i += 1
            del batch
    assert wrong == 0, f"{wrong} frames act with weights other than those of their version"
    assert i == batches
