"""aiocollect's backends, picked by name from one table (:data:`BACKENDS`): ``"process"``
(worker processes forked by the launcher), ``"local"`` (the rollout in the collector's own
process and loop) and ``"ray"`` (Ray actors; Ray is imported only when this backend is used).
Each implements :class:`~aiocollect._backends.seat.Backend` and validates its own options; the
process and Ray backends also open the evaluator's worker (:meth:`ProcessBackend.open_evaluator`).
"""

from __future__ import annotations

import copy
from typing import Any

from .._core.errors import ConfigError
from .._service.resource import in_own_thread
from .failures import STARTING_GRACE
from .launcher import get_launcher
from .seat import Backend, Launch, Sharing


def _needs_workers(name: str, runs_in: str, workers: int) -> None:
    """A backend of worker seats given ``num_workers=0`` (the local backend's setting)."""
    if workers == 0:
        raise ConfigError(
            f"backend={name!r} runs the envs in {runs_in}, but num_workers=0; use num_workers>=1 "
            f"(num_workers=0 is the local backend)"
        )


class ProcessBackend:
    """Worker processes forked on this machine (the default with ``num_workers>=1``)."""

    name = "process"
    weights_in_parent = False
    profiles = True
    serves_inference = True
    opens_evaluator = True
    options_name = None

    def check_options(self, options: Any, workers: int) -> None:
        """This backend takes no options of its own (another backend's are refused by the
        config's table of options); it needs a worker or more."""
        _needs_workers(self.name, "worker processes", workers)

    def warm_up(self, needs: tuple[str, ...]) -> None:
        get_launcher().ensure_started(needs)  # it imports what the workers need meanwhile

    async def start(self, launch: Launch) -> tuple[list[Any], list[dict]]:
        from .workers import start_process_workers  # (the evaluator, which uses this table too, imports no rollout code)

        workers, specs = await start_process_workers(launch.configs, launch.needs, get_launcher(), launch.shutdown_timeout)
        return list(workers), specs

    async def share_slots(self, seats: list[Any], sharing: Sharing) -> tuple[int, Any]:
        from .workers import setup_process_slots

        weight_layout = None if sharing.store is None else sharing.store.layout
        return await setup_process_slots(seats, sharing.layout, sharing.store_fds, weight_layout, sharing.watch)

    async def open_evaluator(self, tg: Any, *, options: Any = None, **kwargs: Any) -> Any:
        """The evaluator's worker, a process (see :meth:`EvalProcess.open
        <aiocollect._backends.eval_process.EvalProcess.open>` for the keywords; it takes no
        ``options``)."""
        from .eval_process import EvalProcess

        return await EvalProcess.open(tg, **kwargs)


class LocalBackend:
    """The rollout in the collector's own process and event loop (``num_workers=0``)."""

    name = "local"
    weights_in_parent = True
    profiles = True
    serves_inference = True
    opens_evaluator = False  # (an evaluator runs its own worker: a process, or a Ray actor)
    options_name = None

    def check_options(self, options: Any, workers: int) -> None:
        """This backend takes no options of its own; it is the collector's process (``num_workers=0``)."""
        if workers != 0:
            raise ConfigError(
                f"backend='local' runs the envs in the collector's own process, but num_workers={workers}; "
                f"use num_workers=0 (and envs_per_worker for the number of envs), or another backend"
            )

    def warm_up(self, needs: tuple[str, ...]) -> None:
        """Nothing to prepare: no process is started."""

    async def start(self, launch: Launch) -> tuple[list[Any], list[dict]]:
        # a replica, as in a worker: the caller's module may change under training (the local
        # rollout yields to the loop mid-batch), weights change only by update_weights (copied
        # here, in the loop: never while the caller's task changes it)
        from .workers import LocalWorker

        replica = copy.deepcopy(launch.policy) if launch.policy is not None else None
        factory = launch.factory

        def build() -> Any:
            policy = replica if replica is not None or factory is None else factory()
            return LocalWorker(launch.configs[0], policy)

        # the factories run in a thread, so that cancelling the start-up is not held up by one
        # that never returns: after STARTING_GRACE it is left to finish there (a thread cannot
        # be killed), and what it builds is closed then
        local = await in_own_thread(build, "aiocollect local start-up",
                                    give_up_after=min(launch.shutdown_timeout, STARTING_GRACE),
                                    discard=LocalWorker.stop_nowait)
        return [local], [local.rollout.spec()]

    async def share_slots(self, seats: list[Any], sharing: Sharing) -> tuple[int, Any]:
        local = seats[0]
        segment = local.setup(sharing.layout)
        if sharing.store is not None:
            await local.give_store(sharing.store)
        return segment


class RayBackend:
    """Each worker a Ray actor, on any node of a Ray cluster (``pip install 'aiocollect[ray]'``)."""

    name = "ray"
    weights_in_parent = True  # (each version is shipped through Ray's object store)
    profiles = False  # (its traces would be files on the actors' machines)
    serves_inference = False  # (the server shares memory with its workers)
    opens_evaluator = True
    options_name = "ray_actor_options"

    def check_options(self, options: Any, workers: int) -> list[dict]:
        """``ray_actor_options`` as one checked dict per worker (a :class:`ConfigError` names
        what is wrong)."""
        from .ray import check_actor_options

        _needs_workers(self.name, "Ray actors", workers)
        return check_actor_options(options, workers)

    def warm_up(self, needs: tuple[str, ...]) -> None:
        """Nothing to prepare here: Ray starts the actors."""

    async def start(self, launch: Launch) -> tuple[list[Any], list[dict]]:
        from .ray import start_ray_workers

        actors, specs = await start_ray_workers(launch.configs, self.check_options(launch.options, len(launch.configs)))
        return list(actors), specs

    async def share_slots(self, seats: list[Any], sharing: Sharing) -> tuple[int, Any]:
        from .ray import setup_ray_slots

        return setup_ray_slots(seats, sharing.layout, sharing.store, sharing.watch)

    async def open_evaluator(self, tg: Any, *, options: Any = None, **kwargs: Any) -> Any:
        """The evaluator's worker, a Ray actor (``options``: ``ray_actor_options`` as given, checked
        and filled in here; see :meth:`RayEvalWorker.open <aiocollect._backends.ray_eval.RayEvalWorker.open>`)."""
        from .ray_eval import RayEvalWorker

        return await RayEvalWorker.open(tg, options=self.check_options(options, 1)[0], **kwargs)


#: Every backend aiocollect ships, by name.
BACKENDS: dict[str, Any] = {"process": ProcessBackend(), "local": LocalBackend(), "ray": RayBackend()}

#: The backends that also open the evaluator's worker (``opens_evaluator``: they have ``open_evaluator``).
EVALUATOR_BACKENDS: tuple[str, ...] = tuple(name for name, b in BACKENDS.items() if b.opens_evaluator)


def backend_choices(choices: tuple[str, ...] = tuple(BACKENDS)) -> str:
    """``choices`` in words, for messages: ``'process', 'local' or 'ray'``."""
    words = [repr(c) for c in choices]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def backend_named(name: str, choices: tuple[str, ...] = tuple(BACKENDS)) -> Any:
    """The backend called ``name`` (one of ``choices``), or a :class:`ConfigError` naming them."""
    if isinstance(name, str) and name in choices:
        return BACKENDS[name]
    listed = ", ".join(repr(c) for c in choices)
    raise ConfigError(f"backend={name!r:.100} is not a backend aiocollect knows; pass one of {listed}")


def backend_object(backend: Any) -> Backend:
    """``backend`` given as an object rather than a name: it must have the members of
    :class:`~aiocollect._backends.seat.Backend` (else a :class:`ConfigError` saying which lack)."""
    if isinstance(backend, Backend):
        return backend
    members = ("name", "weights_in_parent", "profiles", "serves_inference", "check_options", "warm_up", "start",
               "share_slots", "opens_evaluator", "options_name")
    missing = [m for m in members if not hasattr(backend, m)]
    listed = ", ".join(repr(c) for c in BACKENDS)
    raise ConfigError(
        f"backend={backend!r:.100} is neither a backend's name ({listed}) nor a backend object: it lacks "
        f"{', '.join(missing)}; pass a name, or an object with {', '.join(members)}"
    )


__all__ = [
    "BACKENDS",
    "EVALUATOR_BACKENDS",
    "LocalBackend",
    "ProcessBackend",
    "RayBackend",
    "backend_choices",
    "backend_named",
    "backend_object",
]
