"""aiocollect: asyncio-first reinforcement-learning experience collection.

Env workers run in a pool of processes, the policy runs batched, and batches (TensorDicts in
TorchRL's layout) leave through ``async for batch in collector`` and ``await collector.collect()``.

The event types of :mod:`aiocollect.events` are exported here too (``from aiocollect import
EpisodeEnded``). The public names are loaded lazily: worker processes import this package too,
and must not pay for torch or tensordict unless their policy needs them. Asking for
``Collector`` or ``Evaluator`` starts the process that workers are forked from at once, so that
it imports what they need while this process imports the rest (``AIOCOLLECT_NO_PREFORK=1``: not
before the first collector starts).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "Collector": "._collector.collector",
    "CollectorConfig": "._collector.config",
    "CollectorState": "._collector.run",
    "State": "._collector.run",
    "WorkerTimeoutError": "._core.errors",
    "AiocollectError": "._core.errors",
    "ConfigError": "._core.errors",
    "SpecError": "._core.errors",
    "WorkerError": "._core.errors",
    "BrokenWorkerError": "._core.errors",
    "CollectorClosedError": "._core.errors",
    "EndOfCollection": "._core.errors",
    "split_trajectories": "._collector.split",
    "shutdown_launcher": "._backends.launcher",
    "CollectorStats": "._collector.stats",
    "SubscriptionOverflowError": "._core.errors",
    "Subscription": "._service.bus",
    "ProfileConfig": "._core.profiling",
    "ReplayBuffer": "._replay.buffer",
    "Sampler": "._replay.samplers",
    "UniformSampler": "._replay.samplers",
    "StalenessAwareSampler": "._replay.samplers",
    "SliceSampler": "._replay.samplers",
    "SamplingError": "._core.errors",
    "Evaluator": "._evaluator.evaluator",
    "EvaluatorConfig": "._evaluator.config",
    "EvaluatorState": "._evaluator.config",
    "EvaluatorBusyError": "._core.errors",
    "EvaluatorClosedError": "._core.errors",
    # the event types, also here (as the docs' `collector.on(EpisodeEnded, ...)` reads); their
    # module stays aiocollect.events, where the reference documents them
    "AfterRollout": ".events",
    "BatchReady": ".events",
    "BeforeRollout": ".events",
    "CollectorStarted": ".events",
    "CollectorStopped": ".events",
    "EpisodeEnded": ".events",
    "EvaluationCompleted": ".events",
    "EvaluationFailed": ".events",
    "Event": ".events",
    "ProfileTraceReady": ".events",
    "WeightsApplied": ".events",
    "WeightsUpdated": ".events",
    "WorkerEvent": ".events",
    "WorkerFailed": ".events",
    "WorkerRestarted": ".events",
    "WorkerStarted": ".events",
}

__all__ = sorted(_EXPORTS) + ["__version__", "events", "testing"]

# names whose users start worker processes: asking for one starts the launcher (see _backends.launcher)
_PREFORK_ON = frozenset({"Collector", "Evaluator"})

if TYPE_CHECKING:  # pragma: no cover
    from ._collector.collector import Collector as Collector
    from ._service.bus import Subscription as Subscription
    from ._collector.run import CollectorState as CollectorState
    from ._collector.run import State as State
    from ._collector.stats import CollectorStats as CollectorStats
    from ._collector.config import CollectorConfig as CollectorConfig
    from ._core.errors import AiocollectError as AiocollectError
    from ._core.errors import BrokenWorkerError as BrokenWorkerError
    from ._core.errors import CollectorClosedError as CollectorClosedError
    from ._core.errors import ConfigError as ConfigError
    from ._core.errors import EndOfCollection as EndOfCollection
    from ._core.errors import SamplingError as SamplingError
    from ._core.errors import SpecError as SpecError
    from ._core.errors import SubscriptionOverflowError as SubscriptionOverflowError
    from ._core.errors import WorkerError as WorkerError
    from ._core.errors import WorkerTimeoutError as WorkerTimeoutError
    from ._backends.launcher import shutdown_launcher as shutdown_launcher
    from ._evaluator.evaluator import Evaluator as Evaluator
    from ._core.errors import EvaluatorBusyError as EvaluatorBusyError
    from ._core.errors import EvaluatorClosedError as EvaluatorClosedError
    from ._evaluator.config import EvaluatorConfig as EvaluatorConfig
    from ._evaluator.config import EvaluatorState as EvaluatorState
    from ._core.profiling import ProfileConfig as ProfileConfig
    from ._replay.buffer import ReplayBuffer as ReplayBuffer
    from ._replay.samplers import Sampler as Sampler
    from ._replay.samplers import SliceSampler as SliceSampler
    from ._replay.samplers import StalenessAwareSampler as StalenessAwareSampler
    from ._replay.samplers import UniformSampler as UniformSampler
    from ._collector.split import split_trajectories as split_trajectories
    from .events import AfterRollout as AfterRollout
    from .events import BatchReady as BatchReady
    from .events import BeforeRollout as BeforeRollout
    from .events import CollectorStarted as CollectorStarted
    from .events import CollectorStopped as CollectorStopped
    from .events import EpisodeEnded as EpisodeEnded
    from .events import EvaluationCompleted as EvaluationCompleted
    from .events import EvaluationFailed as EvaluationFailed
    from .events import Event as Event
    from .events import ProfileTraceReady as ProfileTraceReady
    from .events import WeightsApplied as WeightsApplied
    from .events import WeightsUpdated as WeightsUpdated
    from .events import WorkerEvent as WorkerEvent
    from .events import WorkerFailed as WorkerFailed
    from .events import WorkerRestarted as WorkerRestarted
    from .events import WorkerStarted as WorkerStarted


def __getattr__(name: str) -> Any:
    if name in ("events", "testing"):
        return importlib.import_module(f".{name}", __name__)
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'aiocollect' has no attribute {name!r}")
    if name in _PREFORK_ON:
        from ._backends.launcher import prefork

        prefork()  # (before the import below, which loads torch: they run side by side)
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
