"""The collector's side of weight synchronisation, the one owner of ``update_weights``: its
arguments checked once, the shared weight store (or one per worker when their policies differ)
or the inference server's own copy of the weights, versions, per-worker acknowledgements and
the :class:`~aiocollect.events.WeightsUpdated`/:class:`~aiocollect.events.WeightsApplied`
events, and turning what a user passes into the tensors of each worker's (or the server's)
policy."""

from __future__ import annotations

import logging
import operator
import os
import time
import weakref
from typing import Any, Awaitable, Callable, Iterable, Mapping

import anyio
import anyio.lowlevel
import numpy as np

from .._core import shm as _shm
from .. import events as ev
from .._core.errors import AiocollectError, BrokenWorkerError, ConfigError, LoopGone, WeightsMismatchError
from .._worker.weights import WeightLayout, WeightStore, is_model_id, named

_KEEP = 1024  # publication times kept for the latency of WeightsApplied
log = logging.getLogger("aiocollect")


class Updates(dict):
    """What ``update_weights`` was given, ``{model id: weights or None}``, and how: through
    ``weights_dict`` or ``policy_or_weights`` (with ``model_id``), so that errors name it."""

    def __init__(self, updates: Mapping[str, Any], *, from_dict: bool) -> None:
        super().__init__(updates)
        self.from_dict = from_dict

    def argument(self, model_id: str) -> str:
        return f"weights_dict[{model_id!r}]" if self.from_dict else "policy_or_weights"


def _argument(updates: Mapping[str, Any], model_id: str) -> str:
    name = getattr(updates, "argument", None)
    return name(model_id) if name is not None else f"the weights for {model_id!r}"


def _index(w: Any) -> int | None:
    """``w`` as a worker index (an int, a numpy or torch integer scalar; never a bool)."""
    if isinstance(w, bool) or type(w).__name__ == "bool_":
        return None
    try:
        return operator.index(w)
    except Exception:  # noqa: BLE001 - TypeError, or whatever an odd __index__ raises
        return None


def check_worker_ids(worker_ids: Any, n: int) -> list[int]:
    """The workers ``worker_ids`` names (``None``: all ``n``), sorted, without repeats; raises
    :class:`ConfigError` for anything but an index or a non-empty collection of indices < ``n``."""
    if worker_ids is None:
        return list(range(n))
    one = _index(worker_ids)
    if one is not None:
        ids: list[int | None] = [one]
    elif isinstance(worker_ids, (str, bytes, bytearray, Mapping)) or not isinstance(worker_ids, Iterable):
        ids = []
    else:
        try:
            ids = [_index(w) for w in worker_ids]
        except Exception:  # noqa: BLE001 - iterable in name only (a 0-d array), or its iteration failed
            ids = []
    if not ids or any(i is None or not 0 <= i < n for i in ids):
        raise ConfigError(
            f"worker_ids={worker_ids!r:.100}: this collector has workers 0..{n - 1}; pass None (all of them), "
            f"a worker index or a list of them"
        )
    return sorted(set(ids))  # type: ignore[arg-type]


STALE_POLICY = (
    "aiocollect: the collector's policy (the `policy` given to Collector) was changed in place (trained) "
    "after the workers were given weight version %d, and another batch was handed out since without an update: the "
    "workers (or the inference server) hold their own copy of the policy and keep collecting with version %d. "
    "Publish the weights after each training step: `await collector.update_weights(policy)` (blocking code: "
    "`collector.update_policy_weights_()`), or pass update_at_each_batch=True; with prefetch=0 (sync delivery's "
    "default) each batch is then collected with the newest weights. (Said once per collector; if you publish "
    "every few batches on purpose, this is expected.)"
)


class InPlaceWatch:
    """Watches the constructor's ``policy`` (a module, in this process) for changes made in place
    that were never published. TorchRL's in-process collector steps the user's module itself, so
    ported scripts train it in place and never publish; here each worker has its own replica, so
    such a script would collect with the first weights for ever, silently.

    Cheap enough for every batch handed out: it reads each tensor's version counter
    (``tensor._version``, bumped by every in-place operation on it or a view: optimizer steps,
    ``copy_``, ``load_state_dict``) and whether a parameter got a new gradient (a backward pass
    through it: optimizers with ``fused=True`` change parameters without bumping the counter).
    Changes through ``.data`` are not seen. :meth:`mark` takes the reference (at start and at
    each publish); :meth:`handed_out` warns once, on the ``aiocollect`` logger, when the policy
    changed since the last publish and a whole batch interval went by without one (the order
    ``publish, train, next batch`` is fine)."""

    def __init__(self, policy: Any) -> None:
        self.policy = policy
        self.tensors: list[Any] = []  # what update_weights publishes: parameters and persistent buffers
        self.params: list[Any] = []  # for their gradients
        self.versions: list[int] = []
        self.grads: list[Any] = []  # per parameter: None, or (weakref to its gradient, the gradient's version)
        self.version = 0  # the weight version published at the last mark
        self.since = 0  # batches handed out since the last mark
        self.active = False
        self.warned = False

    def mark(self, version: int) -> None:
        """The workers get (or got) the policy's weights as they are now. Walks the module (its
        tensors may have been replaced since: ``policy.to(...)`` makes new buffers)."""
        try:
            params: list[Any] = []
            buffers: list[Any] = []
            for module in self.policy.modules():  # (what its state dict holds: parameters, persistent buffers)
                params.extend(p for p in module._parameters.values() if p is not None)
                skip = module._non_persistent_buffers_set
                buffers.extend(b for name, b in module._buffers.items() if b is not None and name not in skip)
            # (inference-mode tensors have no version counter, and cannot be changed in place outside it)
            self.tensors = [t for t in params + buffers if not t.is_inference()]
            self.params = [p for p in params if p.requires_grad]
            self.versions = [t._version for t in self.tensors]
            self.grads = [None if (g := p.grad) is None else (weakref.ref(g), g._version) for p in self.params]
        except Exception:  # noqa: BLE001 - an odd module (lazy parameters ...): the watch is advice, never an error
            self.active = False
            return
        self.version, self.since, self.active = version, 0, True

    def changed(self) -> bool:
        """The policy changed in place (or got new gradients) since :meth:`mark`."""
        if [t._version for t in self.tensors] != self.versions:
            return True
        for p, was in zip(self.params, self.grads):
            g = p.grad
            if was is None:
                if g is not None:
                    return True
            elif was[0]() is not g or g._version != was[1]:
                return True
        return False

    def handed_out(self) -> None:
        """A batch was handed to the consumer."""
        if not self.active or self.warned:
            return
        try:
            changed = bool(self.since) and self.changed()
        except Exception:  # noqa: BLE001 - (as in mark)
            self.active = False
            return
        if changed:
            self.warned = True
            self.active = False  # (said once: nothing more to check)
            log.warning(STALE_POLICY, self.version, self.version)
        self.since += 1


def watch_for(config: Any) -> InPlaceWatch | None:
    """A watch over the constructor's policy where the workers (or the inference server) run a
    copy that only ``update_weights`` changes; ``None`` where in-place changes reach the
    collection anyway (``server_weights="shared"`` runs the module itself) or are published
    before each batch (``update_at_each_batch``), or where there is no module to watch."""
    import sys

    nn = sys.modules.get("torch.nn")
    policy = getattr(config, "policy", None)
    if nn is None or not isinstance(policy, nn.Module):
        return None
    if (config.inference == "server" and config.server_weights == "shared") or config.update_at_each_batch:
        return None
    return InPlaceWatch(policy)


def torchrl_arguments(
    policy_or_weights: Any, *, weights: Any, policy: Any, worker_ids: Any, model_id: Any, weights_dict: Any,
    wait: Any, **kwargs: Any,
) -> dict[str, Any]:
    """The ``update_weights`` keywords for a call of ``update_policy_weights_`` with TorchRL
    0.14.1's names (``policy_or_weights``, ``weights=``, ``policy=``, its deprecated
    ``policy_weights=``, ``worker_ids=``, ``model_id=``, ``weights_dict=``); :class:`ConfigError`
    for what has no meaning here (devices as worker ids, ``{worker index: weights}``, two ways
    of passing the weights), :class:`ConfigTypeError` for an unknown keyword."""
    from .._core.errors import ConfigTypeError

    legacy = kwargs.pop("policy_weights", None)
    if kwargs:
        name = next(iter(kwargs))
        raise ConfigTypeError(
            f"update_policy_weights_() got the keyword {name}={kwargs[name]!r:.60}, which it does not take: it takes "
            f"TorchRL's policy_or_weights, weights=, policy=, worker_ids=, model_id= and weights_dict= (and wait=), "
            f"with the meanings of update_weights()"
        )
    given = {name: value for name, value in (
        ("policy_or_weights", policy_or_weights), ("weights", weights), ("policy", policy), ("policy_weights", legacy),
    ) if value is not None}
    if len(given) > 1:
        first, second = list(given)[:2]
        raise ConfigError(
            f"update_policy_weights_() got both {first}= and {second}=: they are the same argument (the weights, or "
            f"the module that has them); pass one"
        )
    source = next(iter(given.values()), None)
    keys = list(source.keys()) if isinstance(source, Mapping) else []  # (a TensorDict has no truth value)
    if keys and all(_index(k) is not None for k in keys):
        raise ConfigError(
            f"update_policy_weights_() got {{worker index: weights}} (keys {keys[:4]}): per-worker weights "
            f"are published one worker at a time here; call update_policy_weights_(weights, worker_ids=[index]) for "
            f"each (or `await collector.update_weights(weights, worker_ids=[index])`)"
        )
    if _is_device(worker_ids) or (
        isinstance(worker_ids, (list, tuple)) and worker_ids and all(_is_device(w) for w in worker_ids)
    ):
        raise ConfigError(
            f"worker_ids={worker_ids!r:.80}: TorchRL's collectors may name workers by device; here workers are named "
            f"by index (0..num_workers-1); pass None (all of them), an index or a list of indices"
        )
    out: dict[str, Any] = {"policy_or_weights": source, "worker_ids": worker_ids, "wait": wait}
    if weights_dict is not None:
        if model_id is not None:
            raise ConfigError(
                f"update_policy_weights_() got both model_id={model_id!r} and weights_dict: weights_dict names its "
                f"models in its keys; pass one of them"
            )
        out["weights_dict"] = weights_dict
    elif model_id is not None:
        out["model_id"] = model_id
    return out


def _is_device(obj: Any) -> bool:
    import sys

    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.device)


# -- what update_weights is given, as the tensors of a policy ---------------------------------------


def state_of(obj: Any, argument: str = "policy_or_weights") -> dict[str, Any]:
    """A name -> tensor mapping from what a user passes to ``update_weights``: an ``nn.Module``
    (or ``TensorDictModule``, unwrapped as the workers unwrap it), a ``TensorDict`` of
    parameters (``TensorDict.from_module``) or a state dict (str keys). Anything else raises
    :class:`ConfigError` naming ``argument``."""
    import torch

    from .._worker.policy import classify

    if isinstance(obj, torch.nn.Module):
        kind, fn, _, _ = classify(obj)
        module = fn if isinstance(fn, torch.nn.Module) else obj
        return dict(module.state_dict())
    if _is_tensordict(obj):
        return dict(obj.flatten_keys(".").items())
    if isinstance(obj, Mapping):
        bad = [k for k in obj if not isinstance(k, str)]
        if bad:
            raise ConfigError(
                f"{named(argument, obj)} has the key {bad[0]!r}: a state dict is keyed by parameter names (strs); pass "
                f"module.state_dict(), TensorDict.from_module(module) or the module"
            )
        return dict(obj)
    raise ConfigError(
        f"{argument}={obj!r:.80} (of type {type(obj).__name__}) is not weights: update_weights() takes an nn.Module, "
        f"a TensorDict of parameters (TensorDict.from_module(module)) or a state dict (module.state_dict())"
    )


def _is_tensordict(obj: Any) -> bool:
    return getattr(obj, "flatten_keys", None) is not None and hasattr(obj, "batch_size")


def check_weights(obj: Any, argument: str) -> None:
    """What can be told of weights before the workers' policy is known (:func:`state_of`'s checks)."""
    import torch

    if not isinstance(obj, torch.nn.Module) and not _is_tensordict(obj):
        state_of(obj, argument)


def match_state(
    state: Mapping[str, Any], layout: WeightLayout, model_id: str = "policy", whole: bool = False,
    argument: str = "policy_or_weights",
) -> dict[str, Any]:
    """The tensors of model ``model_id`` (see :meth:`WeightLayout.select`) from ``state``, keyed
    by their names in ``layout``. ``state`` is keyed as that model names them (a ``module.``
    prefix, as a TensorDictModule's own state dict has, is dropped when that makes the names
    match), or as the whole policy names them when ``whole``. Each must be a tensor with data,
    of the layout's shape and of a dtype that casts to the layout's safely (``float64`` to
    ``float32`` does, ``float`` to ``int64`` or ``complex`` to ``float`` does not); else
    :class:`ConfigError` (:class:`WeightsMismatchError` for missing tensors) naming ``argument``."""
    import torch

    prefix, names = layout.select(model_id)
    if whole:
        prefix = ""
    want = [n[len(prefix):] for n in names]
    if not set(state) >= set(want):
        stripped = {k.split(".", 1)[1]: v for k, v in state.items() if k.startswith("module.")}
        if set(stripped) >= set(want):
            state = stripped
        elif prefix and (set(state) >= set(names) or set(stripped) >= set(names)):
            # keyed as the whole policy names them (the policy itself, or its state dict)
            state, want = (state if set(state) >= set(names) else stripped), list(names)
        else:
            missing = sorted(set(want) - set(state))
            what = "policy" if model_id == "policy" else f"model {model_id!r}"
            listed = sorted(want)[:5]
            raise WeightsMismatchError(
                f"the weights given for {model_id!r} lack {missing[:5]}{' ...' if len(missing) > 5 else ''} of the "
                f"workers' {what} (it has {len(want)} tensors: {listed}{' ...' if len(want) > 5 else ''}); pass "
                f"that module, TensorDict.from_module(module) or module.state_dict() as {named(argument, state)}"
            )
    out = {}
    shapes = dict(zip(layout.names, layout.shapes))
    dtypes = dict(zip(layout.names, layout.dtypes))
    for name, key in zip(names, want):
        value = state[key]
        if not isinstance(value, torch.Tensor) or value.layout != torch.strided or value.is_meta:
            what = type(value).__name__ if not isinstance(value, torch.Tensor) else f"a {value.layout} tensor on {value.device}"
            raise ConfigError(
                f"{argument} has {key!r} = {value!r:.60}, {what}, for {model_id!r}: the weights must be dense "
                f"tensors with data; pass module.state_dict() or TensorDict.from_module(module)"
            )
        if tuple(value.shape) != shapes[name]:
            raise ConfigError(
                f"the weights given for {model_id!r} ({argument}) have {key!r} of shape {tuple(value.shape)}, but the "
                f"workers' policy has it of shape {shapes[name]}: the model differs from the one the workers built"
            )
        target = torch.from_numpy(np.empty(0, dtype=np.dtype(dtypes[name]))).dtype
        if not torch.can_cast(value.dtype, target):
            raise ConfigError(
                f"the weights given for {model_id!r} ({argument}) have {key!r} of dtype {value.dtype}, which does "
                f"not cast safely to the workers' {target}: the model differs from the one the workers built"
            )
        out[name] = value
    return out


WRITE_SLICE_S = 0.0005  # a store is written in parts; the loop runs between them after this long


async def _write(store: Any, state: Mapping[str, Any], version: int) -> BaseException | None:
    """``store.publish(state, version)``, letting the event loop run whenever a part of the
    copy has taken ``WRITE_SLICE_S`` since it last ran (a big policy: tens of milliseconds of
    copying would stop everything else on the loop). Called shielded: the version lands whole;
    a native ``task.cancel()``, which a shield lets through on asyncio, is returned, to be
    raised once every store has it. Nothing is written into a store released meanwhile (the run
    ended)."""
    if store.closed:
        return None
    parts = store.publish_in_parts(state, version)
    cancelled: BaseException | None = None
    try:
        since = time.perf_counter()
        for _ in parts:
            if time.perf_counter() - since >= WRITE_SLICE_S:
                try:
                    await anyio.lowlevel.checkpoint()
                except anyio.get_cancelled_exc_class() as exc:
                    cancelled = exc
                since = time.perf_counter()
    finally:
        parts.close()
        if store.closed:  # the run ended during the write: unmapped now that the write let go of it
            store.release()
    return cancelled


class WeightSync:
    """Owned by a collector for one run of its workers (made anew by each launch).
    ``serving``: ``inference="server"``, where updates go to the server's weights (one policy
    for every worker) once :meth:`serve` gave it."""

    def __init__(self, policy: Any, local: bool, emit: Callable[..., Awaitable[None]], workers: int,
                 serving: bool = False) -> None:
        self.policy = policy  # the constructor's reference policy (None: built by factories)
        self.local = local  # local backend: stores in process memory
        self._emit = emit
        self.num_workers = workers
        self.serving = serving
        self.server: Any = None  # the run's InferenceServer (its weights are the store)
        self.store: Any = None  # the store every worker reads (None: no weights, or distinct policies)
        self.worker_stores: dict[int, Any] = {}  # per-worker stores, made on first need
        self.layouts: list[Any] = []  # per worker (None: its policy has no weights)
        self.workers: dict[int, Any] = {}
        self.version = 0
        self.acked: list[int] = []
        self.published_at: dict[int, float] = {}
        self._changed = anyio.Event()  # set (and replaced) at each acknowledgement
        self._fds: list[int] = []  # the stores' memfds: kept for workers that replace failed ones
        self.watch: InPlaceWatch | None = None  # the constructor's policy, watched for unpublished training
        self._writing: anyio.Event | None = None  # while a version is written into the stores: set at its end

    def setup(self, layouts: list[Any], workers: list[Any]) -> dict[int, tuple[int, ...]]:
        """Workers' policy layouts known: make the shared store if they all have the same one.
        Returns, per worker, the store fds it must map."""
        self.layouts = list(layouts)
        self.workers = {w.index: w for w in workers}
        self.acked = [0] * len(workers)
        if self.watch is not None:
            self.watch.mark(self.version)  # the workers were given the policy as it is now
        first = self.layouts[0]
        if first is not None and all(w == first for w in self.layouts):
            self.store = self._new_store(first, "weights")
        if self.store is None or self.store.fd is None:
            return {}
        return {w.index: (self.store.fd,) for w in workers}

    def serve(self, server: Any) -> None:
        """Server inference: updates are loaded into ``server``'s own weights."""
        self.server = server

    @property
    def can_pull(self) -> bool:
        """``update_at_each_batch`` can publish the reference policy to all workers."""
        return self.store is not None or (self.server is not None and self.server.weights_layout is not None)

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        for store in (self.store, *self.worker_stores.values()):
            if store is not None:  # unmapped now (a write still under way: once it ends)
                store.release()
        self.store = None
        self.worker_stores.clear()
        self.workers = {}
        self.server = None
        self.notify()

    def bump(self) -> int:
        """A new version that no worker will apply (the workers are done): returned so that
        the caller's version numbers go on counting (published, as far as the caller can tell:
        batches still buffered follow)."""
        return self._next_version()

    # -- checks ---------------------------------------------------------------------------------
    def request(
        self, policy_or_weights: Any, model_id: Any, weights_dict: Any, worker_ids: Any, wait: Any, started: bool,
    ) -> tuple[Updates, list[int]]:
        """The arguments of ``update_weights``, each checked once: what it updates
        ({model id: weights or None}) and the workers it targets. Everything that does not need
        the workers' policy is told here, before a collector starts; before it started
        (``started`` false) the weights are matched against the constructor's policy too."""
        if not isinstance(model_id, str):
            raise ConfigError(f"model_id={model_id!r} must be a str: 'policy' or 'policy.<submodule path>'")
        if weights_dict is not None:
            if policy_or_weights is not None or model_id != "policy":
                raise ConfigError(
                    "pass either weights_dict={model_id: weights, ...} or policy_or_weights (with model_id), not both"
                )
            if not isinstance(weights_dict, Mapping) or not weights_dict:
                raise ConfigError(f"weights_dict={weights_dict!r} must be a non-empty {{model_id: weights}} mapping")
            updates = Updates(weights_dict, from_dict=True)
        else:
            updates = Updates({model_id: policy_or_weights}, from_dict=False)
        if not isinstance(wait, bool):
            raise ConfigError(f"wait={wait!r} must be True or False")
        self.check_model_ids(updates)
        targets = check_worker_ids(worker_ids, self.num_workers)
        if self.serving and len(targets) != self.num_workers:
            raise ConfigError(
                "inference='server' runs one policy for every worker: update_weights() cannot target some "
                "workers (worker_ids); leave worker_ids=None"
            )
        for name, weights in updates.items():
            if weights is not None:
                check_weights(weights, updates.argument(name))
        if not started:
            self.check_before_start(updates)
        return updates, targets

    def check_model_ids(self, updates: Mapping[str, Any]) -> None:
        """What can be told before the workers' layouts are known (overlaps are found by the
        tensors the ids name, in :meth:`_state_for`)."""
        where = "weights_dict has the model id" if getattr(updates, "from_dict", False) else "model_id="
        for a in updates:
            if not is_model_id(a):
                raise ConfigError(
                    f"{where}{a!r}: a model is the workers' policy, 'policy', or one of its submodules, "
                    f"'policy.<path>' (e.g. 'policy.actor')"
                )
        missing = [a for a, w in updates.items() if w is None]
        if missing and self.policy is None:
            raise ConfigError(
                f"{_argument(updates, missing[0])}=None: update_weights() needs weights, and this collector was built "
                f"with policy_factory, so it has no policy of its own to take them from; pass the weights"
            )

    def check_before_start(self, updates: Mapping[str, Any]) -> None:
        """Before the workers exist: match ``updates`` against the constructor's policy (each
        worker's replica has its tensors), so that an update that cannot fit starts nothing."""
        import torch

        if not isinstance(self.policy, torch.nn.Module):
            return  # built by factories, or not a module: told by the workers' layouts
        layout = WeightLayout.of(state_of(self.policy, "policy"))
        if layout.names:
            self._state_for(layout, updates, None)

    def _check_targets(self, ids: list[int]) -> None:
        """The targeted workers' policies (or the server's) have weights to update."""
        if self.server is not None:
            if self.server.weights_layout is None:
                raise AiocollectError(
                    "the inference server's policy has no weights to update (a policy that is not an nn.Module)"
                )
            return
        no_weights = [w for w in ids if self.layouts[w] is None]
        if no_weights:
            raise AiocollectError(
                f"the policy of worker{'s' if len(no_weights) > 1 else ''} {', '.join(map(str, no_weights))} "
                f"has no weights to update (random actions, or a policy that is not an nn.Module)"
            )

    def _state_for(self, layout: Any, updates: Mapping[str, Any], worker: int | None) -> dict[str, Any]:
        """The tensors ``updates`` gives, keyed by their names in ``layout`` (a worker's policy)."""
        state: dict[str, Any] = {}
        owner: dict[str, str] = {}
        for model_id, weights in updates.items():
            argument = _argument(updates, model_id)
            try:
                if weights is None:  # the constructor's policy: the model's part of it
                    part = match_state(state_of(self.policy), layout, model_id, whole=True, argument="policy")
                else:
                    part = match_state(state_of(weights, argument), layout, model_id, argument=argument)
                both = [n for n in part if n in owner]
                if both:  # nested ids, or two ids for one submodule (with and without a TensorDictModule's "module.")
                    raise ConfigError(
                        f"model ids {owner[both[0]]!r} and {model_id!r} overlap: both update {both[0]!r} of the "
                        f"workers' policy; pass one of them in weights_dict"
                    )
            except ConfigError as exc:
                if worker is None:
                    raise
                raise type(exc)(f"worker {worker}: {exc.args[0]}") from None
            owner.update(dict.fromkeys(part, model_id))
            state.update(part)
        return state

    # -- publishing -----------------------------------------------------------------------------
    async def publish(self, updates: Mapping[str, Any], targets: list[int]) -> int:
        """Write ``updates`` ({model id: weights or None}) as one new version for ``targets``;
        nothing is written unless it fits every target's policy. Under server inference the
        server's own weights take it at once, between two forward passes, and every worker has
        applied it when this returns (its :class:`~aiocollect.events.WeightsApplied` follow)."""
        self._check_targets(targets)
        server = self.server  # (the run may end while the load waits for a forward pass)
        if server is not None:
            state = self._state_for(server.weights_layout, updates, None)
            version = self._next_version()
            t0 = time.perf_counter()
            await server.load(state, version)
            latency = time.perf_counter() - t0
            for w in targets:
                self.acked[w] = version
            self.notify()
        else:
            version = await self._write_stores(updates, targets)
        ids = tuple(updates)
        await self._emit(ev.WeightsUpdated, version=version, model_id=ids[0], model_ids=ids, workers=tuple(targets))
        if server is not None:
            for w in targets:
                await self._emit(ev.WeightsApplied, version=version, worker=w, latency=latency)
        return version

    def _next_version(self) -> int:
        """A new version, published now (the in-place watch takes it as its reference)."""
        self.version += 1
        if self.watch is not None:
            self.watch.mark(self.version)
        return self.version

    async def _write_stores(self, updates: Mapping[str, Any], targets: list[int]) -> int:
        """Worker inference: the new version into the shared store (or the targets' own), then
        each target is nudged to apply it at its next batch boundary."""
        shared = self.store is not None and len(targets) == len(self.layouts)
        if shared:
            writes = [(self.store, self._state_for(self.store.layout, updates, None))]
        else:
            writes, by_layout = [], {}
            for w in targets:
                layout = self.layouts[w]
                if layout not in by_layout:  # workers with the same policy layout: matched once
                    by_layout[layout] = self._state_for(layout, updates, None if self.store else w)
                writes.append((w, by_layout[layout]))
        # one write at a time, so that each version lands whole and in order. (Not anyio.Lock: a
        # task.cancel() landing in its acquire() leaves a reference cycle through the task, which
        # keeps the stores and the caller's last batch mapped until the garbage collector runs.)
        while self._writing is not None:
            await self._writing.wait()
        self._writing = writing = anyio.Event()
        cancelled: BaseException | None = None
        try:
            stores = []
            for store, state in writes:
                if not shared:
                    if store not in self.workers:
                        continue  # the run ended while this waited: no store to make for it
                    store = await self._worker_store(store)
                stores.append((store, state))
            with anyio.CancelScope(shield=True):  # (its number is made: it lands, then a cancel is raised)
                version = self._next_version()
                self.published_at[version] = time.perf_counter()
                for store, state in stores:
                    cancelled = await _write(store, state, version) or cancelled
        finally:
            self._writing = None
            writing.set()
        if cancelled is not None:
            try:
                raise cancelled
            finally:
                cancelled = None  # (no cycle through this frame)
        for w in targets:
            worker = self.workers.get(w)
            if worker is None:
                continue  # the run ended while this version was written
            try:
                await worker.nudge()
            except (BrokenWorkerError, LoopGone):
                pass  # it died (its replacement, if any, reads the newest version when it starts), or collection ended
        return version

    async def _worker_store(self, index: int) -> Any:
        store = self.worker_stores.get(index)
        if store is None:
            store = self._new_store(self.layouts[index], f"w{index}-weights")
            self.worker_stores[index] = store
            await self.workers[index].give_store(store)
        return store

    def _new_store(self, layout: Any, name: str) -> Any:
        if self.local:
            store = WeightStore.create(layout, bytearray(layout.nbytes))
            store.fd = None
            return store
        fd, mm = _shm.allocate(layout.nbytes, f"aiocollect-{os.getpid()}-{name}")
        store = WeightStore.create(layout, mm)
        store.fd = fd  # closed with the run
        self._fds.append(fd)
        return store

    # -- acknowledgements -----------------------------------------------------------------------
    async def on_applied(self, worker: Any, version: int) -> None:
        if version > self.acked[worker.index]:
            self.acked[worker.index] = version
        self.notify()
        published = self.published_at.get(version)
        oldest = min(self.acked)
        while self.published_at:  # oldest first: drop those applied everywhere, or too old to matter
            first = next(iter(self.published_at))
            if first > oldest and len(self.published_at) <= _KEEP:
                break
            del self.published_at[first]
        await self._emit(
            ev.WeightsApplied, version=version, worker=worker.index,
            latency=0.0 if published is None else time.perf_counter() - published,
        )

    def notify(self) -> None:
        """Wake every waiter of :meth:`wait_applied` (an acknowledgement, or the run changed)."""
        changed, self._changed = self._changed, anyio.Event()
        changed.set()

    async def wait_applied(self, version: int, targets: list[int], collecting: Callable[[], bool]) -> bool:
        """Until every target acknowledged ``version``; ``False`` if the workers stopped
        collecting first (``collecting()`` turned false)."""
        while any(self.acked[w] < version for w in targets):
            if not collecting():
                return False
            await self._changed.wait()  # every waiter waits on the same event: none is missed
        return True
