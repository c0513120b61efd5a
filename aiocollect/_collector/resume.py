"""A collector's seeds and the counters it resumes from: the work behind
:meth:`Collector.set_seed <aiocollect.Collector.set_seed>`,
:meth:`~aiocollect.Collector.state_dict` and :meth:`~aiocollect.Collector.load_state_dict`
(which document it), on the state of the collector's run
(:class:`~aiocollect._collector.run_state.RunState`)."""

from __future__ import annotations

from typing import Any, Mapping

from .._core.errors import AiocollectError, ConfigError
from .._core.limits import check_seed
from .run_state import Phase, RunState


def require_created(run: RunState, what: str) -> None:
    if run.phase is not Phase.CREATED:
        raise AiocollectError(
            f"{what} must be called before the collector starts (it is {run.public_state.value}); call it "
            f"right after constructing the collector, before `async with` / start()"
        )


def set_seed(run: RunState, seed: int, static_seed: bool) -> int:
    require_created(run, "set_seed()")
    check_seed(seed, offset=run.config.seed_offset, optional=False)
    if not isinstance(static_seed, bool):
        raise ConfigError(f"static_seed={static_seed!r} must be True or False")
    run.seeding.seed, run.seeding.static_seed = seed, bool(static_seed)
    return seed if static_seed else seed + run.total_rows


def state_dict(run: RunState) -> dict[str, Any]:
    counts, seed, static_seed = run.counts, run.seeding.seed, run.seeding.static_seed
    counters = counts.traj_counters or counts.start_counters or [0] * run.total_rows
    return {
        "frames": counts.frames,
        "batches": counts.batches,
        "collected_frames": counts.collected,
        "traj_counters": [k + 1 for k in counters] if counts.traj_counters else list(counters),
        "seed": seed,
        "static_seed": static_seed,
        "next_seed": None if seed is None else (seed if static_seed else seed + run.total_rows),
    }


def load_state_dict(run: RunState, state: Any) -> None:
    require_created(run, "load_state_dict()")
    config = run.config
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
    check_seed(state.get("next_seed"), "state['next_seed']", offset=config.seed_offset)
    if not isinstance(state.get("static_seed", False), bool):
        raise ConfigError(f"state has static_seed={state['static_seed']!r}, not True or False; {fix}")
    if not counters or len(counters) % config.total_envs:  # (vector envs: checked again at start)
        raise ConfigError(
            f"state has trajectory counters for {len(counters)} envs, this collector has "
            f"{config.total_envs}; resume with the same num_workers * envs_per_worker"
        )
    total = config.total_frames
    if total != -1 and frames > total:
        raise ConfigError(f"state has {frames} frames, more than total_frames={total}")
    run.counts.frames, run.counts.batches = frames, batches
    run.counts.collected = collected
    run.counts.start_counters = counters
    run.seeding.seed, run.seeding.static_seed = state.get("next_seed"), state.get("static_seed", False)


__all__ = ["load_state_dict", "require_created", "set_seed", "state_dict"]
