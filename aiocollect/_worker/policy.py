"""Policies: how the collector classifies the policy it is given (in the user's process) and how
a worker runs it on a batch of observations.

Imported by worker processes: a worker with a random policy never imports torch, and one with a
plain ``nn.Module`` (or a simple ``TensorDictModule``, which is unwrapped) never imports
tensordict: both imports are lazy.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import numpy as np
from gymnasium import spaces

from .._core.datachecks import dtype_problem
from .._core.errors import ConfigTypeError, SpecError
from .._core.layout import Key, Leaf, as_key, flattener, is_bare, unflattener

if TYPE_CHECKING:
    from .recurrent import RecurrentMemory

EXPLORATION_TYPES = ("random", "deterministic", "mode", "mean", "median")


@dataclasses.dataclass(frozen=True)
class PolicySpec:
    """What a worker needs to rebuild the policy: picklable, no torch objects outside ``payload``.

    kind: ``"random"`` (sample the action space), ``"module"`` (a callable on tensors, mapped from
    ``in_keys`` to ``out_keys``), ``"tensordict"`` (a callable taking and returning a TensorDict),
    ``"factory"`` (``payload`` builds one of the others in the worker) or ``"server"`` (the
    collector's inference server acts: :class:`~aiocollect._worker.inference_client.RemoteRunner`).
    """

    kind: str
    payload: bytes = b""
    in_keys: tuple[Key, ...] = (("observation",),)
    out_keys: tuple[Key, ...] = (("action",),)
    exploration_type: str = "random"
    state: tuple[Leaf, ...] = ()  # recurrent_state: the state a TensorDict policy carries (see .recurrent)

    @property
    def needs(self) -> tuple[str, ...]:
        """Modules a worker imports before running it (imported once, in the launcher)."""
        if self.kind in ("random", "server"):
            return ()
        if self.kind == "tensordict":
            return ("torch", "tensordict")
        return ("torch",)


def _torch_nn() -> Any:
    return sys.modules.get("torch.nn")


def loaded_class(module: str, name: str) -> Any:
    """The class ``name`` of ``module`` if that module is imported, else None (never imports it;
    typed Any: an instance of it is whatever the class is).
    A module that another thread is still importing may not have it yet: None too (and no object
    is an instance of it yet)."""
    cls = getattr(sys.modules.get(module), name, None)
    return cls if isinstance(cls, type) else None


def _simple_tensordict_module(obj: Any) -> bool:
    """A ``TensorDictModule`` that only maps in_keys to out_keys with its inner module: run the
    inner module directly, so that the worker needs no tensordict import."""
    td_module = loaded_class("tensordict.nn", "TensorDictModule")
    if td_module is None or type(obj) is not td_module:
        return False
    return (
        getattr(obj, "method", None) is None
        and not getattr(obj, "method_kwargs", None)
        and isinstance(obj.in_keys, (list, tuple))
        and len(obj.out_keys) >= 1
    )


def classify(
    obj: Any, recurrent: bool = False, out_keys: tuple[Key, ...] | None = None
) -> tuple[str, Any, tuple[Key, ...], tuple[Key, ...]]:
    """``(kind, callable, in_keys, out_keys)`` for a policy object (not a factory); a
    ``recurrent`` one is never unwrapped (it reads its state from the TensorDict). ``out_keys``
    (``policy_out_keys``) names the tuple a plain ``nn.Module`` returns."""
    if not recurrent and _simple_tensordict_module(obj):
        return ("module", obj.module, tuple(as_key(k) for k in obj.in_keys), tuple(as_key(k) for k in obj.out_keys))
    td_base = loaded_class("tensordict.nn", "TensorDictModuleBase")
    nn = _torch_nn()
    if td_base is not None and isinstance(obj, td_base):
        return ("tensordict", obj, (), ())
    if nn is not None and isinstance(obj, nn.Module):
        return ("module", obj, (("observation",),), out_keys or (("action",),))
    if callable(obj):
        return ("tensordict", obj, (), ())
    raise ConfigTypeError(
        f"policy must be callable, got {type(obj).__name__}; pass a function or module that maps a "
        "TensorDict of observations to one with an 'action', or policy=None for random actions"
    )


def describe(
    policy: Any, policy_factory: Any, exploration_type: str, state: tuple[Leaf, ...] = (),
    out_keys: Any = None,
) -> PolicySpec:
    """Parent side: the :class:`PolicySpec` sent to workers (``state``: ``recurrent_state``'s
    leaves; ``out_keys``: ``policy_out_keys``)."""
    from .._core import pickling as _pickling

    named: dict[str, Any] = {} if out_keys is None else {"out_keys": out_keys}
    if policy_factory is not None:
        return PolicySpec("factory", _pickling.dumps(policy_factory), exploration_type=exploration_type, state=state,
                          **named)
    if policy is None:
        return PolicySpec("random", exploration_type=exploration_type)
    kind, fn, in_keys, out_keys = classify(policy, is_recurrent(policy, state), out_keys)
    if kind == "module":
        return PolicySpec("module", _pickling.dumps(fn), in_keys, out_keys, exploration_type)
    return PolicySpec("tensordict", _pickling.dumps(fn), exploration_type=exploration_type, state=state)


def is_recurrent(policy: Any, state: tuple[Leaf, ...]) -> bool:
    """Whether ``policy`` carries a state: declared (``state``), or TorchRL's primer on a module."""
    from .recurrent import has_primer

    return bool(state) or (policy is not None and has_primer(policy))


def check_out_keys(out_keys: Any, policy: Any) -> tuple[Key, ...] | None:
    """``policy_out_keys`` as keys (``None``: not given): names (a str, or a tuple of strs for a
    nested key), one per output of a plain ``nn.Module``'s tuple, ``"action"`` among them, each
    once; refused for a policy that names its outputs itself (a TensorDict policy)."""
    if out_keys is None:
        return None
    example = "policy_out_keys=['action', 'sample_log_prob', 'state_value']"
    if isinstance(out_keys, str) or not isinstance(out_keys, (list, tuple)) or not out_keys:
        raise ConfigTypeError(
            f"policy_out_keys={out_keys!r:.100} must be a list of names, one per tensor the policy returns, in order: "
            f"e.g. {example}"
        )
    keys = []
    for key in out_keys:
        nested = isinstance(key, tuple) and key and all(isinstance(k, str) and k for k in key)
        if not (isinstance(key, str) and key) and not nested:
            raise ConfigTypeError(
                f"policy_out_keys={list(out_keys)!r:.100}: {key!r:.60} is not a name; each entry is a str (or a tuple "
                f"of strs for a nested key), e.g. {example}"
            )
        keys.append(as_key(key))
    if ("action",) not in keys:
        raise ConfigTypeError(
            f"policy_out_keys={list(out_keys)!r:.100} does not name the action: one of the policy's outputs must be "
            f"'action' (what the envs step with), e.g. {example}"
        )
    if len(set(keys)) != len(keys):
        twice = next(k for k in keys if keys.count(k) > 1)
        raise ConfigTypeError(f"policy_out_keys={list(out_keys)!r:.100} names {'.'.join(twice)!r} twice; name each output once")
    if policy is not None and (classify(policy)[0] != "module" or _simple_tensordict_module(policy)):
        raise ConfigTypeError(
            f"policy_out_keys={list(out_keys)!r:.100} names the tensors a plain nn.Module returns, but the policy is a "
            f"{type(policy).__name__}, which writes its outputs into the TensorDict under keys of its own (a "
            f"TensorDictModule's out_keys): drop policy_out_keys"
        )
    return tuple(keys)


def check_recurrent_policy(policy: Any, state: tuple[Leaf, ...]) -> None:
    """``recurrent_state`` needs a TensorDict policy: a plain module (observation tensor in,
    action out) has nowhere to read its state from, nor to write it to."""
    if not state or policy is None or classify(policy, recurrent=True)[0] == "tensordict":
        return
    keys = [".".join(leaf.key) for leaf in state]
    raise ConfigTypeError(
        f"recurrent_state={ {k: leaf.shape for k, leaf in zip(keys, state)} } needs a TensorDict policy, but the policy "
        f"is a plain {type(policy).__name__} (observation tensor in, action out): wrap it in a "
        f"tensordict.nn.TensorDictModule with in_keys=['observation', {', '.join(map(repr, keys))}, 'is_init'] and "
        f"out_keys=['action', {', '.join(repr(('next', k)) for k in keys)}], or drop recurrent_state"
    )


# -- runners (worker side, or in-process for the local backend) ----------------------------------


class EnvActions:
    """Turns stored action leaves (arrays ``[E, ...]``) into what each env's ``step`` takes."""

    def __init__(self, space: spaces.Space, leaves: list[Leaf]) -> None:
        self.leaves = leaves
        self.single = is_bare(space)  # (a one-leaf Dict/Tuple space takes a dict/tuple)
        self.discrete = self.single and isinstance(space, spaces.Discrete)
        # categorical_action_encoding=False: the stored action is one-hot, the env takes its index
        self.one_hot = self.discrete and leaves[0].shape == (int(space.n),)  # type: ignore[attr-defined]
        self.start = int(getattr(space, "start", 0)) if self.discrete else 0
        self.unflatten = unflattener(space)

    def per_env(self, arrays: list[np.ndarray], num_envs: int) -> Sequence[Any]:
        if self.one_hot:
            return self.indices(arrays[0])
        if self.discrete:
            return arrays[0].tolist()
        if self.single:
            return list(arrays[0])
        return [self.unflatten([a[i] for a in arrays]) for i in range(num_envs)]

    def indices(self, one_hot: np.ndarray) -> list[int]:
        """Each row's index (plus the space's ``start``); a row that is not one-hot (exactly one 1,
        zeros elsewhere) is a :class:`SpecError`."""
        ok = ((one_hot == 0) | (one_hot == 1)).all(-1) & (one_hot.sum(-1) == 1)
        if not ok.all():
            row = int(np.flatnonzero(~ok)[0])
            raise SpecError(
                f"the policy wrote 'action' {one_hot[row].tolist()} for env row {row}, which is not one-hot "
                f"(categorical_action_encoding=False takes one-hot actions of shape [{one_hot.shape[-1]}]: a single 1); "
                f"write a one-hot action (e.g. torch.nn.functional.one_hot(index, n)), or drop the option and write "
                f"the index"
            )
        return (one_hot.argmax(-1) + self.start).tolist()


class RandomRunner:
    """Samples each env's own copy of the action space (seeded per env, so the same seed gives the
    same actions whatever the number of workers)."""

    uses_torch = False
    model = None  # no weights to synchronise
    remote = False
    version = 0  # (runners' common interface; a remote runner's is its server's)

    def __init__(self, action_spaces: list[spaces.Space], act_leaves: list[Leaf]) -> None:
        self.spaces = action_spaces
        self.flatten = flattener(action_spaces[0], "action")
        self.single = is_bare(action_spaces[0])
        self.dtypes = [leaf.np_dtype for leaf in act_leaves]
        space = action_spaces[0]
        # categorical_action_encoding=False: random Discrete actions stored one-hot, as TorchRL's OneHot.rand()
        self.one_hot = (
            np.eye(int(space.n), dtype=np.int64) if isinstance(space, spaces.Discrete) and act_leaves[0].shape == (int(space.n),)
            else None
        )

    def act(
        self, obs: list[np.ndarray], rows: np.ndarray | None = None, is_init: np.ndarray | None = None,
    ) -> tuple[Sequence[Any], list[np.ndarray], list[np.ndarray]]:
        samples = [space.sample() for space in self.spaces]
        if self.one_hot is not None:
            start = int(self.spaces[0].start)  # type: ignore[attr-defined]
            arrays = [self.one_hot[np.asarray(samples, dtype=np.int64) - start]]
        elif self.single:
            arrays = [np.asarray(samples, dtype=self.dtypes[0])]
        else:
            flat = [self.flatten(s) for s in samples]
            arrays = [np.asarray([f[j] for f in flat], dtype=dt) for j, dt in enumerate(self.dtypes)]
        return samples, arrays, []

    def probe(self, obs: list[np.ndarray]) -> list[Leaf]:
        return []


def act_leaves_shape(leaves: list[Leaf]) -> tuple[int, ...]:
    return leaves[0].shape if len(leaves) == 1 else ()


def _np_dtype_name(tensor: Any, key: Key) -> str:
    import torch

    try:
        return torch.empty(0, dtype=tensor.dtype).numpy().dtype.name
    except TypeError:
        raise SpecError(
            f"the policy wrote {'.'.join(key)!r} with dtype {tensor.dtype}, which has no numpy "
            f"equivalent for shared-memory storage; cast it to float32 in the policy"
        ) from None


def _cpu_numpy(value: Any) -> np.ndarray | None:
    """``value.numpy()`` where that is a plain view (a cpu tensor outside autograd), else None."""
    try:
        arr = value.numpy()
    except (AttributeError, TypeError, RuntimeError):  # not a tensor, not on the cpu, needs grad ...
        return None
    return arr if type(arr) is np.ndarray else None


def _numpy(tensor: Any) -> np.ndarray:
    """A tensor as a numpy array: a view where it is a cpu tensor outside autograd (the common
    case, without the cost of ``detach()`` and ``cpu()``), else a copy on the cpu."""
    arr = _cpu_numpy(tensor)
    return tensor.detach().cpu().numpy() if arr is None else arr


class TorchRunner:
    """Common part of the torch runners (a policy run on ``num_envs`` env rows at once): output
    checks and conversion.

    Driven one way wherever it runs (a worker's rollout, the evaluator, the collector's inference
    server): :meth:`probe` once, then :meth:`act` on each step's observations. A recurrent policy's
    runner carries its rows' state in :attr:`memory`, and ``act(obs, rows=..., is_init=...)``
    says which rows of it a step is (by default all of them, or the first ``num_envs`` of a
    larger shared memory). What the inference server shares among the runners of its passes (one
    memory, its CUDA staging, the compiled policy, the outputs found by the probe) is handed over
    once with :meth:`attach`; nothing else is set from outside."""

    uses_torch = True
    remote = False
    # a runner's per-step path with its names bound (ModuleRunner's, once its first output was
    # checked); None: the general one. What attach() changes makes it anew.
    _fast: Callable[[list[np.ndarray]], tuple[Sequence[Any], list[np.ndarray], list[np.ndarray]]] | None = None

    def __init__(self, act_space: spaces.Space, act_leaves: list[Leaf], obs_leaves: list[Leaf], num_envs: int) -> None:
        import torch

        # observations (numpy) -> the policy's input tensors (attach(to_device=...) on a CUDA device)
        self._from_numpy: Callable[[np.ndarray], Any] = torch.from_numpy
        # a recurrent policy's carried state (TensorDictRunner), and the rows of it a step is by default
        self.memory: RecurrentMemory | None = None
        self._rows: np.ndarray | None = None  # None: all of them
        self.act_space = act_space
        self.act_leaves = act_leaves
        self.obs_leaves = obs_leaves
        self.obs_keys = [leaf.key for leaf in obs_leaves]
        self.num_envs = num_envs
        self.env_actions = EnvActions(act_space, act_leaves)
        self.extra_keys: list[Key] = []
        self.checked = False
        self.act_dtypes: list[Any] = []  # torch dtypes of the first, checked actions
        self.act_shapes = [(num_envs,) + leaf.shape for leaf in act_leaves]

    @property
    def is_init(self) -> np.ndarray | None:
        """A recurrent policy's rows that start an episode at their next step (the rollout sets
        them, :meth:`act` spends them); None for a policy without state."""
        return None if self.memory is None else self.memory.is_init

    def attach(
        self,
        *,
        memory: RecurrentMemory | None = None,
        to_device: Callable[[np.ndarray], Any] | None = None,
        wrap: Callable[[Callable], Callable] | None = None,
        extra_keys: Sequence[Key] | None = None,
        env_actions: Any = None,
    ) -> "TorchRunner":
        """Share with this runner what the runners of other numbers of rows share (the inference
        server's), and return it:

        - ``memory``: the recurrent state of every row served (more rows than this runner's: a
          step names its own with ``act(obs, rows=...)``; by default the first ``num_envs``), in
          place of the runner's own; ignored for a policy without state.
        - ``to_device``: what turns an observation array into the policy's input tensor (on a
          CUDA device: staged in pinned memory, copied without blocking).
        - ``wrap``: applied once to the callable the runner calls (``torch.compile``, a CUDA graph).
        - ``extra_keys``: the policy's extra outputs, as :meth:`probe` found them on another runner.
        - ``env_actions``: what turns the action arrays into each env's action (``per_env``)."""
        if memory is not None and self.memory is not None:
            self.memory = memory
            n = len(memory.is_init)
            self._rows = None if n == self.num_envs else np.arange(self.num_envs)
        if to_device is not None:
            self._from_numpy = to_device
        if wrap is not None:
            self._wrap(wrap)
        if extra_keys is not None:
            self.extra_keys = list(extra_keys)
        if env_actions is not None:
            self.env_actions = env_actions
        self._fast = None
        return self

    def _wrap(self, wrap: Callable[[Callable], Callable]) -> None:
        raise NotImplementedError

    def _check_action(self, key: Key, value: Any, leaf: Leaf) -> np.ndarray:
        import torch

        if not isinstance(value, torch.Tensor):
            raise SpecError(f"the policy wrote {'.'.join(key)!r} as {type(value).__name__}, expected a torch.Tensor")
        want = (self.num_envs,) + leaf.shape
        if tuple(value.shape) != want:
            hint = ""
            if isinstance(self.act_space, spaces.Discrete) and tuple(value.shape) == (self.num_envs, int(self.act_space.n)):
                hint = (
                    " (it looks one-hot or like logits: write the index, e.g. logits.argmax(-1), or for one-hot actions "
                    "as TorchRL's GymEnv takes them pass categorical_action_encoding=False)"
                )
            elif tuple(value.shape) == (self.num_envs, 1) + leaf.shape or tuple(value.shape) == want + (1,):
                hint = " (squeeze the extra dimension)"
            raise SpecError(
                f"the policy wrote {'.'.join(key)!r} with shape {tuple(value.shape)} for {self.num_envs} envs, "
                f"but the action space {self.act_space} needs shape {want} (dtype {leaf.dtype}){hint}"
            )
        return self._to_numpy(key, value, leaf)

    def _to_numpy(self, key: Key, value: Any, leaf: Leaf) -> np.ndarray:
        """``value`` (a tensor of the right shape) as a numpy array of the leaf's dtype: a float
        of another width is rounded, an integer must fit; another kind is a :class:`SpecError`
        (see :mod:`aiocollect._core.datachecks`)."""
        arr = _numpy(value)
        if arr.dtype == leaf.np_dtype:
            return arr
        problem = dtype_problem(arr, leaf.np_dtype, lambda: f"the action space {self.act_space}")
        if problem is not None:
            phrase, kind = problem
            if kind == "range":
                fix = "clip it in the policy, or give the action space a wider dtype"
            elif leaf.np_dtype.kind in "iu":
                fix = "return indices, e.g. logits.argmax(-1)"
            elif leaf.np_dtype.kind == "f":
                fix = (
                    f"return floats, e.g. action.to(torch.{leaf.dtype}) (integer actions for a continuous "
                    f"space usually mean a discrete policy head on a Box action space)"
                )
            else:
                fix = f"return {leaf.dtype} values"
            raise SpecError(f"the policy wrote {'.'.join(key)!r}, which {phrase}; {fix}")
        return arr.astype(leaf.np_dtype)

    def _missing_action(self, outputs: dict[Key, Any]) -> None:
        for leaf in self.act_leaves:
            if leaf.key not in outputs:
                raise SpecError(
                    f"the policy wrote no {'.'.join(leaf.key)!r}: it must write the action for "
                    f"{self.act_space} (it wrote {sorted('.'.join(k) for k in outputs)})"
                )

    def _convert(self, outputs: dict[Key, Any]) -> tuple[Sequence[Any], list[np.ndarray], list[np.ndarray]]:
        if not self.checked:
            self._missing_action(outputs)
            arrays = [self._check_action(leaf.key, outputs[leaf.key], leaf) for leaf in self.act_leaves]
            self.act_dtypes = [outputs[leaf.key].dtype for leaf in self.act_leaves]
            self.checked = True
        else:
            arrays = []
            for leaf, dtype, want in zip(self.act_leaves, self.act_dtypes, self.act_shapes):
                value = outputs.get(leaf.key)
                if value is None:
                    self._missing_action(outputs)
                # the common case, seen with numpy's cheap attributes: a cpu tensor of the leaf's
                # shape and dtype (anything else is checked in full, as on the first call)
                arr = _cpu_numpy(value)
                if arr is not None and arr.shape == want and arr.dtype == leaf.np_dtype:
                    arrays.append(arr)
                elif getattr(value, "dtype", None) == dtype and tuple(getattr(value, "shape", ())) == want:
                    # the first call's dtype (converted), or not on the cpu (copied there)
                    arrays.append(self._to_numpy(leaf.key, value, leaf))
                else:
                    arrays.append(self._check_action(leaf.key, value, leaf))
        extras = [_numpy(outputs[k]) for k in self.extra_keys]
        return self.env_actions.per_env(arrays, self.num_envs), arrays, extras

    def _extra_leaves(self, outputs: dict[Key, Any]) -> list[Leaf]:
        import torch

        known = set(self.obs_keys) | {leaf.key for leaf in self.act_leaves}
        leaves = []
        for key, value in outputs.items():
            if key in known:
                continue
            if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != self.num_envs:
                raise SpecError(
                    f"the policy wrote {'.'.join(key)!r} with shape {getattr(value, 'shape', None)}; every "
                    f"policy output needs a leading dimension of {self.num_envs} (one row per env)"
                )
            leaves.append(Leaf(key, tuple(value.shape[1:]), _np_dtype_name(value, key)))
        self.extra_keys = [leaf.key for leaf in leaves]
        return leaves

    def probe(self, obs: list[np.ndarray]) -> list[Leaf]:
        """Run the policy once (without touching torch's RNG), check its outputs and return the
        extra leaves it writes."""
        import torch

        with torch.random.fork_rng(devices=[]):
            try:
                outputs = self._forward(obs)
            except Exception as exc:  # a policy built for other observations: said as such
                from .shapes import input_mismatch

                error = input_mismatch(exc, self, obs)
                if error is None:
                    raise
                raise error from exc
        self._missing_action(outputs)
        extras = self._extra_leaves(outputs)
        self._convert(outputs)
        return extras

    def act(
        self, obs: list[np.ndarray], rows: np.ndarray | None = None, is_init: np.ndarray | None = None,
    ) -> tuple[Sequence[Any], list[np.ndarray], list[np.ndarray]]:
        """One step's actions for the observations ``obs`` (one array per leaf, ``num_envs`` rows):
        each env's action, the action arrays and the extra outputs' arrays. A recurrent policy
        reads and writes the state of ``rows`` of its :attr:`memory` (default: see :meth:`attach`),
        whose episode starts are ``is_init`` (default: the memory's own flags)."""
        return self._convert(self._forward(obs, rows, is_init))

    def _forward(
        self, obs: list[np.ndarray], rows: np.ndarray | None = None, is_init: np.ndarray | None = None,
    ) -> dict[Key, Any]:
        raise NotImplementedError


def _missing_inputs(
    missing: list[Key], obs_keys: Sequence[Key], out_keys: Sequence[Key], otherwise: str | None = None,
) -> SpecError | None:
    """The error of a policy that reads ``missing`` keys, which the observations lack: declare its
    state where it looks recurrent, else ``otherwise`` (None: no error)."""
    from .recurrent import undeclared_state_fix

    fix = undeclared_state_fix(missing, out_keys) or otherwise
    if fix is None:
        return None
    return SpecError(
        f"the policy reads {['.'.join(k) for k in missing]}, which the observations do not have "
        f"(they have {['.'.join(k) for k in obs_keys]}); {fix}"
    )


class ModuleRunner(TorchRunner):
    """A callable on tensors: inputs are the ``in_keys`` observation leaves; it returns a tensor
    (the action, or the one output ``out_keys`` names), a tuple of tensors named by ``out_keys``
    (``policy_out_keys``), or a dict of tensors that names them itself (``{"action": a,
    "sample_log_prob": lp, "state_value": v}``; nested dicts give nested keys). Every output but
    the action lands in the batch under its name."""

    def __init__(self, module: Callable, in_keys: tuple[Key, ...], out_keys: tuple[Key, ...], *args: Any) -> None:
        super().__init__(*args)
        import torch

        self.module = module
        self.model = module if isinstance(module, torch.nn.Module) else None
        # what the per-step path calls, looked up once
        self._grad_enabled, self._no_grad = torch.is_grad_enabled, torch.no_grad
        self.out_keys = list(out_keys)
        self.single_out = len(self.out_keys) == 1 and self.out_keys[0] == ("action",) and is_bare(self.act_space)
        self.want_shape: tuple[int, ...] = (self.num_envs,) + act_leaves_shape(self.act_leaves)
        self.want_dtype = self.act_leaves[0].np_dtype if self.act_leaves else None
        index = {key: i for i, key in enumerate(self.obs_keys)}
        missing = [k for k in in_keys if k not in index]
        error = _missing_inputs(missing, self.obs_keys, out_keys, "wrap the module in a tensordict.nn.TensorDictModule "
                                "with matching in_keys") if missing else None
        if error is not None:
            raise error
        self.in_idx = [index[k] for k in in_keys]
        self.in0 = self.in_idx[0] if len(self.in_idx) == 1 else None

    def act(
        self, obs: list[np.ndarray], rows: np.ndarray | None = None, is_init: np.ndarray | None = None,
    ) -> tuple[Sequence[Any], list[np.ndarray], list[np.ndarray]]:
        fast = self._fast
        if fast is not None:
            return fast(obs)
        if not (self.checked and self.single_out):  # (a module carries no state: rows and is_init are moot)
            return super().act(obs)
        self._fast = fast = self._fast_act()
        return fast(obs)

    def _fast_act(self) -> Callable[[list[np.ndarray]], tuple[Sequence[Any], list[np.ndarray], list[np.ndarray]]]:
        """The per-step path of a module writing only the action, once its first output was checked:
        no dict, no copy, and every name it needs looked up once, here (at 8 CartPole envs a step
        of the policy's own is a few microseconds: an attribute read is a percent of it). The
        output is checked through its numpy view (cheap attributes); anything but a cpu tensor of
        the action's shape and dtype goes through the full conversion, with its checks and
        messages. Made again after :meth:`attach` or a change of the outputs (``_fast = None``)."""
        module, from_numpy, in0, in_idx = self.module, self._from_numpy, self.in0, self.in_idx
        grad_enabled, no_grad = self._grad_enabled, self._no_grad
        want_shape, want_dtype, num_envs = self.want_shape, self.want_dtype, self.num_envs
        env_actions, convert, named, cpu_numpy = self.env_actions, self._convert, self._named, _cpu_numpy
        as_list = isinstance(env_actions, EnvActions) and env_actions.discrete and not env_actions.one_hot
        per_env = env_actions.per_env

        def fast(obs: list[np.ndarray]) -> tuple[Sequence[Any], list[np.ndarray], list[np.ndarray]]:
            inputs = (from_numpy(obs[in0]),) if in0 is not None else [from_numpy(obs[i]) for i in in_idx]
            if grad_enabled():
                with no_grad():
                    out = module(*inputs)
            else:  # worker processes disable autograd once
                out = module(*inputs)
            arr = cpu_numpy(out)
            if arr is None or arr.shape != want_shape or arr.dtype is not want_dtype:
                return convert(named(out))
            return arr.tolist() if as_list else per_env([arr], num_envs), [arr], []

        return fast

    def _forward(
        self, obs: list[np.ndarray], rows: np.ndarray | None = None, is_init: np.ndarray | None = None,
    ) -> dict[Key, Any]:
        import torch

        with torch.no_grad():
            out = self.module(*[self._from_numpy(obs[i]) for i in self.in_idx])
        return self._named(out)

    def _wrap(self, wrap: Callable[[Callable], Callable]) -> None:
        self.module = wrap(self.module)  # (self.model stays the module: its weights)
        self._fast = None

    def _named(self, out: Any) -> dict[Key, Any]:
        """The module's outputs by key: a dict names them itself, a tuple (or list) is named by
        ``out_keys`` in order, a lone tensor is the first of ``out_keys``."""
        if isinstance(out, Mapping):
            named = _flat_outputs(out)
            if ("action",) not in named and not any(leaf.key in named for leaf in self.act_leaves):
                raise SpecError(
                    f"the policy returned a dict without 'action' (its keys: {sorted('.'.join(k) for k in named)}): "
                    f"a policy returning a dict must put the action under 'action'; its other entries land in the "
                    f"batch under their names"
                )
            self.single_out = False  # (the fast path takes a lone tensor)
            self._fast = None
            return named
        outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        if len(outs) != len(self.out_keys):
            names = [".".join(k) for k in self.out_keys]
            if self.out_keys == [("action",)]:
                what = f"a plain nn.Module's output is the action alone ({names})"
                fix = ("pass policy_out_keys naming each output in order, 'action' among them (e.g. policy_out_keys="
                       "['action', 'sample_log_prob', 'state_value']), or return a dict {'action': action, "
                       "'sample_log_prob': log_prob, ...}")
            else:
                what = f"policy_out_keys names {len(names)}: {names}"
                fix = "return one tensor per name of policy_out_keys, in order (or a dict of them)"
            raise SpecError(
                f"the policy returned {len(outs)} {'tensors' if len(outs) > 1 else 'tensor'}, but {what}; {fix}"
            )
        return dict(zip(self.out_keys, outs))


def _flat_outputs(out: Mapping, prefix: Key = ()) -> dict[Key, Any]:
    """A (nested) dict of outputs as ``{key: value}``: ``{"action": a, "extra": {"h": h}}`` gives
    ``("action",)`` and ``("extra", "h")``."""
    flat: dict[Key, Any] = {}
    for name, value in out.items():
        key = prefix + as_key(name)
        if isinstance(value, Mapping):
            flat.update(_flat_outputs(value, key))
        else:
            flat[key] = value
    return flat


class TensorDictRunner(TorchRunner):
    """A callable taking and returning a TensorDict of batch size ``[num_envs]``, run under
    tensordict's interaction type ``exploration_type``."""

    def __init__(self, policy: Callable, exploration_type: str, *args: Any, state: tuple[Leaf, ...] = ()) -> None:
        super().__init__(*args)
        import torch

        # tensordict itself first: a collector's start imports it in a thread of its own, and a
        # submodule imported here meanwhile would run against the half-imported package
        # ("cannot import name ... from partially initialized module 'tensordict.nn'"); importing
        # the package waits for that import to finish
        import tensordict  # noqa: F401
        from tensordict.nn import InteractionType

        self.policy = policy
        # (a simple TensorDictModule's weights are its inner module's, as update_weights unwraps it)
        inner = getattr(policy, "module") if _simple_tensordict_module(policy) else policy
        self.model = inner if isinstance(inner, torch.nn.Module) else None
        self.interaction = InteractionType(exploration_type)
        from .recurrent import RecurrentMemory, primer_leaves

        leaves = state or primer_leaves(policy)
        # recurrent: the carried state (the rollout marks episode starts in its is_init; the
        # inference server attaches one shared by its passes)
        self.memory = RecurrentMemory(leaves, self.num_envs) if leaves else None

    def probe(self, obs: list[np.ndarray]) -> list[Leaf]:
        if self.memory is None:
            self._check_undeclared_state()
            return super().probe(obs)
        kept = self.memory.saved()  # (the probe's step is not one of the run's)
        try:
            return super().probe(obs)
        finally:
            self.memory.restore(kept)

    def _check_undeclared_state(self) -> None:
        """A policy that reads a state of its own but declares none (its ``in_keys``, where it has
        them, lack from the observations ``is_init`` or a key it writes under ``"next"``)."""
        in_keys = [as_key(k) for k in getattr(self.policy, "in_keys", None) or ()]
        missing = [key for key in in_keys if key not in set(self.obs_keys)]
        error = _missing_inputs(missing, self.obs_keys, [as_key(k) for k in getattr(self.policy, "out_keys", None) or ()])
        if error is not None:
            raise error

    def _forward(
        self, obs: list[np.ndarray], rows: np.ndarray | None = None, is_init: np.ndarray | None = None,
    ) -> dict[Key, Any]:
        import torch
        from tensordict import TensorDict, TensorDictBase
        from tensordict.nn import set_interaction_type

        td = TensorDict({}, batch_size=[self.num_envs])
        for key, arr in zip(self.obs_keys, obs):
            td.set(key, self._from_numpy(arr))
        memory = self.memory
        if memory is not None:
            if rows is None:
                rows = self._rows
            for key, arr in memory.inputs(rows, is_init):
                td.set(key, self._from_numpy(arr))  # (on CUDA: staged as the observations are)
        with torch.no_grad(), set_interaction_type(self.interaction):
            out = self.policy(td)
        if out is None:
            out = td
        if not isinstance(out, TensorDictBase):
            raise SpecError(
                f"the policy returned {type(out).__name__}; a TensorDict policy must return the TensorDict "
                f"(or None after writing into it); a plain nn.Module taking the observation tensor is "
                f"wrapped automatically"
            )
        outputs = {as_key(k): out.get(k) for k in out.keys(include_nested=True, leaves_only=True)}
        if memory is not None:
            memory.carry(outputs, rows, _numpy)
        return outputs

    def _wrap(self, wrap: Callable[[Callable], Callable]) -> None:
        self.policy = wrap(self.policy)  # (self.model stays the module: its weights)


def build_runner(
    spec: PolicySpec,
    act_space: spaces.Space,
    act_leaves: list[Leaf],
    obs_leaves: list[Leaf],
    num_envs: int,
    action_spaces: list[spaces.Space],
    local_policy: Any = None,
) -> Any:
    """Worker side. ``local_policy`` is the user's object itself (local backend: no copy)."""
    import cloudpickle

    kind, payload, in_keys, out_keys = spec.kind, None, spec.in_keys, spec.out_keys
    if kind == "random":
        return RandomRunner(action_spaces, act_leaves)
    if kind == "server":
        from .inference_client import RemoteRunner

        return RemoteRunner(EnvActions(act_space, act_leaves), num_envs)
    if local_policy is not None or kind == "factory":
        obj = local_policy if local_policy is not None else cloudpickle.loads(spec.payload)()
        check_recurrent_policy(obj, spec.state)
        if spec.out_keys != PolicySpec.out_keys:  # policy_out_keys: for a plain module only
            check_out_keys(spec.out_keys, obj)
        kind, payload, in_keys, out_keys = classify(obj, is_recurrent(obj, spec.state), spec.out_keys)
    else:
        payload = cloudpickle.loads(spec.payload)
    return make_runner(kind, payload, in_keys, out_keys, spec.exploration_type, (act_space, act_leaves, obs_leaves, num_envs),
                       spec.state)


def make_runner(
    kind: str, fn: Any, in_keys: tuple[Key, ...], out_keys: tuple[Key, ...], exploration_type: str, common: tuple,
    state: tuple[Leaf, ...] = (),
) -> Any:
    """The runner of a classified policy (``common``: action space, action and observation leaves, rows)."""
    if kind == "module":
        return ModuleRunner(fn, in_keys, out_keys, *common)
    return TensorDictRunner(fn, exploration_type, *common, state=state)
