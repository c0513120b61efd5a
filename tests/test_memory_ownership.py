"""A run's memory dies with it: what a collector allocates (its slots' segment: a memfd, its
mapping and the views on it) is released once the collector is closed and its caller has dropped
what it took, on every path, a refused start included. A collector refused at start-up keeps
nothing alive either: its error's traceback refers to the caller's frame, and through it to the
batches of the collectors the caller opens next, so nothing global (the collector's finalizer)
may keep that error once the collector is closed.

The reported program: in one event loop, collectors over Dict-space envs whose keys collide with
the batch layout (each refused with a ``SpecError``), then one over ``{"observation": Box(2)}``
that collects 2 batches of 40 frames (1 worker, 2 envs); after it returns and ``gc.collect()``,
no fd, mapping or memoryview of theirs may be left."""

from __future__ import annotations

import gc
import mmap
import weakref

import numpy as np
import pytest
import torch
from conftest import _shm_in_use
from gymnasium import spaces

from aiocollect import Collector, SpecError
from aiocollect.testing import SpacesEnv

BOX = spaces.Box(-1.0, 1.0, (2,), np.float32)
# top-level keys the batch layout reserves: each space is refused at start-up
COLLIDING = [
    {"action": BOX, "x": BOX},
    {"next": BOX},
    {"collector": BOX},
    {"done": BOX},
    {"terminated": BOX},
]
FRAMES_PER_BATCH = 40
ENVS = 2


def _collector(space: dict) -> Collector:
    return Collector(
        SpacesEnv, create_env_kwargs={"observation_space": spaces.Dict(space), "action_space": spaces.Discrete(2)},
        frames_per_batch=FRAMES_PER_BATCH, total_frames=2 * FRAMES_PER_BATCH, num_workers=1, envs_per_worker=ENVS,
    )


def _views_on_mappings() -> list[memoryview]:
    """The live memoryviews whose object is a memory mapping (what keeps a segment mapped after
    its fd is closed: a numpy array or a tensor over it holds one)."""
    found = []
    for obj in gc.get_objects():
        if type(obj) is memoryview:  # (not isinstance: some of torch's objects warn when asked their __class__)
            try:
                if type(obj.obj) is mmap.mmap:
                    found.append(obj)
            except ValueError:  # released
                continue
    return found


def _check_batch(batch) -> None:
    assert tuple(batch.batch_size) == (ENVS, FRAMES_PER_BATCH // ENVS)
    for key in ("observation", ("next", "observation")):
        obs = batch[key]
        assert obs.shape == (ENVS, FRAMES_PER_BATCH // ENVS, 2) and obs.dtype == torch.float32
        assert bool(((obs >= -1) & (obs <= 1)).all())
    assert bool(((batch["action"] == 0) | (batch["action"] == 1)).all())
    assert bool((batch["next", "reward"] == 1).all())


async def _refused_then_accepted(refused: list[weakref.ref]) -> int:
    """The reported program; returns the number of batches it checked."""
    for space in COLLIDING:
        collector = _collector(space)
        refused.append(weakref.ref(collector))
        with pytest.raises(SpecError, match=f"top-level key {next(iter(space))!r}, which the batch layout reserves"):
            async with collector:
                pytest.fail("a colliding Dict space was accepted")
        del collector
    batches = 0
    async with _collector({"observation": BOX}) as collector:
        async for batch in collector:  # (lent batches: views on the slots' segment)
            _check_batch(batch)
            batches += 1
    return batches


@pytest.mark.timeout(120)
async def test_refused_collectors_keep_nothing_and_the_accepted_ones_memory_dies_with_them():
    """Refused and accepted collectors in one loop: once the program returns, no fd, mapping or
    memoryview of theirs survives, and each refused collector is garbage."""
    views_before = _views_on_mappings()
    refused: list[weakref.ref] = []
    assert await _refused_then_accepted(refused) == 2
    gc.collect()
    assert _shm_in_use() == [], "a slots segment is still open or mapped"
    left = [v for v in _views_on_mappings() if not any(v is b for b in views_before)]
    assert left == [], f"memoryviews on a segment survive, held by {[type(r).__name__ for v in left for r in gc.get_referrers(v)]}"
    assert [ref() for ref in refused] == [None] * len(COLLIDING), "a refused collector is kept alive"


@pytest.mark.timeout(120)
async def test_a_start_refused_without_async_with_lets_go_of_the_callers_batches():
    """``await collector.start()`` refused (a notebook's way, never closed by the caller): the
    collector is closed by its failed start, and then nothing global refers to it, so the batch
    the same caller takes next from another collector is freed with the caller's frame."""

    async def program() -> weakref.ref:
        bad = _collector({"next": BOX})
        with pytest.raises(SpecError, match="'next', which the batch layout reserves"):
            await bad.start()
        gone = weakref.ref(bad)
        del bad
        async with _collector({"observation": BOX}) as collector:
            batch = await collector.collect()
            _check_batch(batch)
        return gone  # (with the batch: a lent slot keeps the segment mapped for as long as it lives)

    views_before = _views_on_mappings()
    gone = await program()
    gc.collect()
    assert gone() is None, "the refused collector is kept alive"
    assert _shm_in_use() == []
    assert [v for v in _views_on_mappings() if not any(v is b for b in views_before)] == []
