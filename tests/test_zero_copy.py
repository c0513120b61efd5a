"""zero_copy=True: batches are views on the workers' shared memory, valid until the consumer asks
for the next batch; and the default batches, lent without a copy while slots can be spared (views
handed back once nothing refers to them), else copied. Complete programs run to their end on real CartPole envs and real worker
processes, with the data checked against a copying collector with the same seed; what a view
shows after it was handed back; zero_copy="debug" crashing a program that reads a handed-back
batch; the options it combines with and those it refuses."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import anyio
import pytest
import torch

from aiocollect import Collector, ConfigError
from aiocollect.testing import CountingEnv

from test_user_programs import Greedy, check_batch, train


def check_counting(batch) -> None:
    """CountingEnv: the next observation of frame t is the observation of frame t+1 unless done."""
    obs, nxt, done = batch["observation"], batch["next", "observation"], batch["next", "done"][..., 0]
    assert bool(((nxt[:, :-1] == obs[:, 1:]).all(-1) | done[:, :-1]).all())
    assert bool((nxt[..., 0] == obs[..., 0] + 1).all()), "next observation is not the step after"


async def _copies(delivery: str, num_workers: int, zero_copy: bool, batches: int = 6) -> list:
    # async delivery grants workers credits up to the slots, whatever prefetch is: the version a
    # batch is collected with depends on timing there, so that run trains without updating
    """The batches of a seeded training run, cloned as they arrive (prefetch=0: each batch is
    collected after the previous update was applied, so its policy versions are deterministic)."""
    torch.manual_seed(0)
    policy = Greedy()
    out = []
    async with Collector("CartPole-v1", policy, frames_per_batch=128, total_frames=128 * batches, seed=3,
                         num_workers=num_workers, envs_per_worker=2, delivery=delivery, zero_copy=zero_copy,
                         prefetch=0) as c:
        async for batch in c:
            check_batch(batch)
            out.append(batch.clone())
            if delivery == "sync":
                train(policy)
                await c.update_weights(policy)
    return out


@pytest.mark.parametrize("num_workers", [0, 2], ids=["local", "process"])
@pytest.mark.parametrize("delivery", ["sync", "async"])
async def test_training_loop_with_zero_copy_batches_gives_the_same_data_as_copies(delivery, num_workers):
    """The canonical loop with zero_copy=True (updates in sync delivery) runs to its natural end
    and, with the same seed, yields exactly the frames a copying collector yields (sync delivery: every batch; async: the
    arrival order may differ, so the same set of per-env trajectories' frames)."""
    with anyio.fail_after(60):
        views = await _copies(delivery, num_workers, zero_copy=True)
        copies = await _copies(delivery, num_workers, zero_copy=False)
    assert len(views) == len(copies) == 6
    if delivery == "sync" or num_workers == 0:
        for a, b in zip(views, copies):
            assert (a == b).all(), "zero_copy data differ from copied data"
    else:  # which worker's batch comes next depends on timing: compare each worker's own sequence
        def per_worker(batches):
            out: dict[int, list] = {}
            for b in batches:
                out.setdefault(int(b["collector", "traj_ids"][0, 0]) % 4 // 2, []).append(b)
            return out

        mine, theirs = per_worker(views), per_worker(copies)
        compared = 0
        for w in mine.keys() & theirs.keys():
            for a, b in zip(mine[w], theirs[w]):
                assert (a == b).all(), f"worker {w}: zero_copy data differ from copied data"
                compared += 1
        assert compared >= 2


async def test_a_zero_copy_batch_is_a_view_that_the_workers_reuse_after_the_next_request():
    """What the docs promise, shown: the batch is shared memory (no copy: the same addresses come
    back once the slots have cycled), and a view kept past the next request shows newer frames."""
    async with Collector(CountingEnv, frames_per_batch=8, total_frames=8 * 12, num_workers=2,
                         envs_per_worker=2, zero_copy=True, prefetch=1) as c:
        kept = await c.collect()
        snapshot = kept.clone()
        addresses = {kept["observation"].data_ptr()}
        seen_again = False
        for _ in range(8):
            batch = await c.collect()
            seen_again |= batch["observation"].data_ptr() in addresses
            addresses.add(batch["observation"].data_ptr())
        assert seen_again, "the slots were never reused: batches are not views on them"
        assert len(addresses) <= c.config.num_slots
        assert not (kept["observation"] == snapshot["observation"]).all(), (
            "a view kept past the next request still shows its old frames: the slot was not reused"
        )
        del kept, batch


async def test_zero_copy_batches_into_a_replay_buffer_and_with_split_trajs():
    """The two ways users keep frames: extend a buffer (which copies) and split_trajs (which
    reshapes into new tensors): both hold the right data after the slots are reused."""
    from aiocollect import ReplayBuffer

    rb = ReplayBuffer(4096)
    async with Collector("CartPole-v1", frames_per_batch=64, total_frames=64 * 6, num_workers=2, seed=1,
                         zero_copy=True) as c:
        async for batch in c:
            rb.extend(batch)
    async with Collector("CartPole-v1", frames_per_batch=64, total_frames=64 * 6, num_workers=2, seed=1) as c:
        expected = torch.cat([b.reshape(-1)["observation"] async for b in c])
    assert len(rb) == 64 * 6
    stored = rb.storage.reshape(-1)[: len(rb)]["observation"]
    assert sorted(map(tuple, stored.tolist())) == sorted(map(tuple, expected.tolist()))

    async with Collector("CartPole-v1", frames_per_batch=64, total_frames=64 * 4, num_workers=2, seed=1,
                         zero_copy=True, split_trajs=True) as c:
        trajs = [b async for b in c]
    for t in trajs:
        obs, nxt, mask = t["observation"], t["next", "observation"], t["collector", "mask"]
        ok = (nxt[:, :-1] == obs[:, 1:]).all(-1) | ~mask[:, 1:]
        assert bool(ok.all()), "a split trajectory of a zero-copy batch broke continuity"


async def test_zero_copy_survives_a_worker_restart_while_the_consumer_holds_a_batch():
    """A worker's env raises mid-run under on_worker_failure="restart": the replacement gets the
    slots that are free (not the one the consumer holds), and the run ends with every batch."""
    with anyio.fail_after(60):
        async with Collector(CountingEnv, frames_per_batch=16, total_frames=16 * 10, num_workers=2,
                             create_env_kwargs={"fail_at_step": 30}, on_worker_failure="restart", max_restarts=10,
                             zero_copy=True, delivery="async") as c:
            n = 0
            async for batch in c:
                check_counting(batch)
                n += 1
            assert n == 10 and c.stats().restarts >= 1


def test_zero_copy_debug_crashes_a_program_that_reads_a_handed_back_batch(tmp_path):
    """zero_copy="debug": reading a batch's memory after asking for the next batch is a fatal
    error whose traceback names the offending line, instead of silently reading newer frames.
    Reading it before that, and the loop as a whole, work as usual."""
    script = tmp_path / "misuse.py"
    script.write_text(textwrap.dedent("""
        import anyio
        from aiocollect import Collector

        async def main():
            async with Collector("CartPole-v1", frames_per_batch=32, total_frames=32 * 20, num_workers=2,
                                 zero_copy="debug") as c:
                first = await c.collect()
                total = float(first["observation"].sum())          # fine: not handed back yet
                async for batch in c:
                    total += float(batch["next", "reward"].sum())  # fine
                print("loop ok", flush=True)
            kept = first["observation"]
            print("reading a handed-back batch", flush=True)
            print(float(kept.sum()))  # MISUSE-LINE

        anyio.run(main)
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert "loop ok" in proc.stdout and "reading a handed-back batch" in proc.stdout, proc.stderr[-2000:]
    assert proc.returncode < 0, f"the misuse was not caught (exit code {proc.returncode}): {proc.stdout[-500:]}"
    assert "Segmentation fault" in proc.stderr
    line = next(i for i, text in enumerate(script.read_text().splitlines(), 1) if "MISUSE-LINE" in text)
    assert "misuse.py" in proc.stderr and f"line {line}" in proc.stderr, proc.stderr[-2000:]


async def test_zero_copy_debug_gives_correct_data_to_a_program_that_uses_it_right():
    with anyio.fail_after(60):
        async with Collector("CartPole-v1", frames_per_batch=64, total_frames=64 * 5, num_workers=2,
                             zero_copy="debug") as c:
            n = 0
            async for batch in c:
                check_batch(batch)
                n += 1
    assert n == 5


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_zero_copy_takes_true_false_or_debug(value):
    with pytest.raises(ConfigError, match="zero_copy="):
        Collector("CartPole-v1", frames_per_batch=8, zero_copy=value)


def test_zero_copy_refuses_trajs_per_batch_and_says_why():
    with pytest.raises(ConfigError, match="trajs_per_batch keeps frames across batches"):
        Collector("CartPole-v1", frames_per_batch=8, zero_copy=True, trajs_per_batch=2)


async def test_default_batches_are_lent_without_a_copy_and_never_touched_while_held():
    """By default a batch is lent (a view on its slot, which goes back to the workers once nothing
    refers to it): a loop that drops its batches gets them all without a copy, and a batch the
    consumer keeps, even through a single view of one of its tensors, is never overwritten."""
    # (prefetch=2: prefetch + 2 = 4 slots per worker may be lent, two of them kept here)
    async with Collector(CountingEnv, frames_per_batch=16, total_frames=16 * 30, num_workers=2,
                         envs_per_worker=2, prefetch=2) as c:
        kept = await c.collect()
        expected = kept.clone()
        view = (await c.collect())["next", "observation"][1:, 2:]  # the rest of that batch is dropped
        expected_view = view.clone()
        async for batch in c:
            check_counting(batch)
            del batch
        loans = c._run.shared.producer.loans
        assert loans.lent >= 20, f"only {loans.lent} of 30 batches were lent"
        assert c.stats().batches_copied == 30 - loans.lent
    assert (kept == expected).all(), "a batch the consumer holds was overwritten"
    assert (view == expected_view).all(), "a view on a held batch was overwritten"


@pytest.mark.parametrize("num_workers", [0, 2], ids=["local", "process"])
@pytest.mark.parametrize("delivery", ["sync", "async"])
async def test_training_loop_that_keeps_some_batches_finds_them_unchanged_at_its_end(delivery, num_workers):
    """The canonical loop with the default batches: train on each, update the weights, keep every
    fourth batch as it came (no clone), run to the natural end. The dropped batches were lent (no
    copy); the kept ones equal what they were when they arrived, though their slots' neighbours
    were written over and over, and the data obey CartPole's dynamics."""
    torch.manual_seed(0)
    policy = Greedy()
    kept, expected = [], []
    with anyio.fail_after(60):
        async with Collector("CartPole-v1", policy, frames_per_batch=128, total_frames=128 * 16, seed=3,
                             num_workers=num_workers, envs_per_worker=2, delivery=delivery) as c:
            n = 0
            async for batch in c:
                check_batch(batch)
                if n % 4 == 0:
                    kept.append(batch)
                    expected.append(batch.clone())
                n += 1
                train(policy)
                await c.update_weights(policy)
            stats = c.stats()
            lent = c._run.shared.producer.loans.lent
    assert n == 16 and stats.batches == 16
    assert lent >= 8 and lent + stats.batches_copied == 16, (lent, stats.batches_copied)
    for k, e in zip(kept, expected):
        assert (k == e).all(), "a kept batch changed after it was delivered"
        check_batch(k)


async def test_a_lent_batch_kept_after_close_stays_valid_and_pins_only_its_own_slot():
    """A lent batch outlives its collector (it is the consumer's); while it is kept, the memory of
    every other slot is freed at the close, and once it is dropped nothing is left mapped."""
    import os

    from test_lifecycle import _aiocollect_mappings

    async with Collector(CountingEnv, frames_per_batch=2 * 2 * 512, total_frames=-1, num_workers=2,
                         envs_per_worker=2) as c:
        for _ in range(12):  # every slot has been written
            kept = await c.collect()
        expected = kept.clone()
        slot_nbytes, num_slots = c._run.shared.pool.slots.layout.slot_nbytes, c.config.num_slots
        assert c.stats().batches_copied == 0
    assert (kept == expected).all()
    check_counting(kept)
    [line] = _aiocollect_mappings()  # the slots' segment, kept mapped by the batch
    inode = line.split()[4]
    resident = None
    for n in os.listdir("/proc/self/fd"):  # the mapping's own descriptor of the memfd
        try:
            st = os.stat(f"/proc/self/fd/{n}")
        except OSError:
            continue  # (listdir's own, closed since)
        if st.st_ino == int(inode):
            resident = st.st_blocks * 512
    assert resident is not None
    assert resident <= 2 * slot_nbytes, (
        f"{resident} bytes of the segment still in memory; one slot is {slot_nbytes} bytes, all {num_slots} are "
        f"{num_slots * slot_nbytes}"
    )
    del kept
    assert _aiocollect_mappings() == []


async def test_batches_kept_beyond_the_loans_are_copies_into_reused_memory_and_loans_come_back():
    """A consumer that keeps more batches than slots can be lent gets copies (the workers never
    wait for its memory); copies of dropped batches go into memory of earlier ones (no page
    faults per batch); once the kept batches are dropped, their slots are lent again."""
    async with Collector(CountingEnv, frames_per_batch=16, total_frames=16 * 40, num_workers=2,
                         envs_per_worker=2, prefetch=1) as c:
        capacity = c.config.lend_slots
        assert capacity == 3
        kept = [await c.collect() for _ in range(capacity + 3)]
        expected = [b.clone() for b in kept]
        assert c.stats().batches_copied >= 3  # no loan left for the last kept ones
        for _ in range(15):
            batch = await c.collect()
            check_counting(batch)
            del batch
        pool = c._run.shared.producer.chunks
        assert pool.reused >= 10, f"only {pool.reused} of 15 copies reused dropped memory"
        assert all((b == e).all() for b, e in zip(kept, expected)), "a batch the consumer holds was overwritten"
        lent = c._run.shared.producer.loans.lent
        del kept, expected
        async for batch in c:
            check_counting(batch)
            del batch
        assert c._run.shared.producer.loans.lent >= lent + 10, "the slots of dropped batches were not lent again"


def _cartpole_vec():
    import gymnasium as gym

    return gym.make_vec("CartPole-v1", num_envs=8, vectorization_mode="vector_entry_point")


async def test_zero_copy_with_vector_envs_gives_the_same_data_as_copies():
    """A worker stepping a vector env writes its sub-envs' rows into the same slots: zero_copy
    batches of 2 workers x 8 sub-envs equal the copies of a run with the same seed."""
    runs = []
    for zero_copy in (True, False):
        async with Collector(_cartpole_vec, frames_per_batch=16 * 8, total_frames=16 * 8 * 4, num_workers=2,
                             seed=5, zero_copy=zero_copy, prefetch=0) as c:
            runs.append([b.clone() async for b in c])
    assert len(runs[0]) == len(runs[1]) == 4
    for a, b in zip(*runs):
        assert a.batch_size == (16, 8)
        check_batch(a)
        assert (a == b).all()
