"""A collector's seeds and the counters it resumes from: the work behind
:meth:`Collector.set_seed <aiocollect.Collector.set_seed>`,
:meth:`~aiocollect.Collector.state_dict` and :meth:`~aiocollect.Collector.load_state_dict`
(which document it), on the run's counters and seeds."""

from __future__ import annotations

from typing import Any, Mapping

from .._core.errors import ConfigError
from .._core.limits import check_seed
from .config import CollectorConfig
from .delivery import Counters
from .pool import Seeding


def set_seed(seeding: Seeding, config: CollectorConfig, total_rows: int, seed: int, static_seed: bool) -> int:
    check_seed(seed, offset=config.geometry.seed_offset, optional=False)
    if not isinstance(static_seed, bool):
        raise ConfigError(f"static_seed={static_seed!r} must be True or False")
    seeding.seed, seeding.static_seed = seed, bool(static_seed)
    return seed if static_seed else seed + total_rows


def state_dict(counts: Counters, seeding: Seeding, total_rows: int) -> dict[str, Any]:
    seed, static_seed = seeding.seed, seeding.static_seed
    counters = counts.traj_counters or counts.start_counters or [0] * total_rows
    return {
        "frames": counts.frames,
        "batches": counts.batches,
        "collected_frames": counts.collected,
        "traj_counters": [k + 1 for k in counters] if counts.traj_counters else list(counters),
        "seed": seed,
        "static_seed": static_seed,
        "next_seed": None if seed is None else (seed if static_seed else seed + total_rows),
    }


def load_state_dict(counts: Counters, seeding: Seeding, config: CollectorConfig, state: Any) -> None:
    fix = "pass what collector.state_dict() returned"
    if not isinstance(state, Mapping):
        raise ConfigError(f"state={state!r:.200} is a {type(state).__name__}, not a state_dict() of a Collector; {fix}")
    try:
        if isinstance(state["traj_counters"], (str, bytes, Mapping)):
            raise TypeError(f"traj_counters is a {type(state['traj_counters']).__name__}, not a list")
        counters = [int(k) for k in state["traj_counters"]]
        frames, batches = int(state["frames"]), int(state["batches"])
        collected = int(state.get("collected_frames", frames))
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(
            f"state={state!r:.200} is not a state_dict() of a Collector ({type(exc).__name__}: {exc}); {fix}"
        ) from None
    negative: list[tuple[str, Any]] = [
        (k, v) for k, v in (("frames", frames), ("batches", batches), ("collected_frames", collected)) if v < 0
    ]
    negative += [("traj_counters", counters)] if any(k < 0 for k in counters) else []
    if negative:
        raise ConfigError(f"state has {negative[0][0]}={negative[0][1]!r:.100}, below 0; {fix}")
    check_seed(state.get("next_seed"), "state['next_seed']", offset=config.geometry.seed_offset)
    if not isinstance(state.get("static_seed", False), bool):
        raise ConfigError(f"state has static_seed={state['static_seed']!r}, not True or False; {fix}")
    if not counters or len(counters) % config.geometry.total_envs:  # (vector envs: checked again at start)
        raise ConfigError(
            f"state has trajectory counters for {len(counters)} envs, this collector has "
            f"{config.geometry.total_envs}; resume with the same num_workers * envs_per_worker"
        )
    total = config.total_frames
    if total is not None and total != -1 and frames > total:
        raise ConfigError(f"state has {frames} frames, more than total_frames={total}")
    counts.frames, counts.batches = frames, batches
    counts.collected = collected
    counts.start_counters = counters
    seeding.seed, seeding.static_seed = state.get("next_seed"), state.get("static_seed", False)


__all__ = ["load_state_dict", "set_seed", "state_dict"]
