"""A policy built for other observations: torch's shape errors on the policy's first call, told as
what they are (recognised by torch's words for them; any other error is left as it is). ``mat1 and mat2 shapes cannot be multiplied (2x4 and 8x16)`` becomes a
:class:`~aiocollect.SpecError` that names the policy's input keys, the observation shape the env
gives and, where the layer can be found, what the policy expects.

"Where it can be found" is exact: the layer named is the one whose ``forward`` raised (found in
the traceback) or, when none is, the policy's first layer with a fixed input size (its first
``Linear``, ``Conv`` or recurrent layer in registration order), said to be only that. Nothing is
guessed: without such a layer the message gives no expected size.

Imported by worker processes: numpy and the standard library; torch lazily (the runners that call
it have it already).
"""

from __future__ import annotations

import re
from typing import Any

from .._core.errors import AiocollectError, SpecError

# torch's words for a shape that does not fit (matmul, conv, layer norm, view, broadcasting, RNNs)
_SHAPE_WORDS = re.compile(
    r"shapes cannot be multiplied|size mismatch|must match the size of tensor|to have \d+ channels"
    r"|Expected \d+D .*input|normalized_shape|is invalid for input of size|must be equal to input_size"
    r"|input\.size\(-1\) must be|Expected input batch_size|expected input with shape"
)


def _layer_types() -> tuple[type, ...]:
    import torch

    nn = torch.nn
    return (nn.Linear, nn.modules.conv._ConvNd, nn.RNNBase)


def _expects(layer: Any) -> tuple[int, str] | None:
    """``(size, where)``: what ``layer`` takes in, and in which dimension of its input."""
    import torch

    nn = torch.nn
    if isinstance(layer, nn.Linear) and not isinstance(layer, nn.LazyLinear):
        return layer.in_features, "input features (its input's last dimension)"
    if isinstance(layer, nn.modules.conv._ConvNd) and not isinstance(layer, nn.modules.lazy.LazyModuleMixin):
        d = len(layer.kernel_size)
        return layer.in_channels, f"channels (dimension {-d - 1} of its input, channels first: [N, C, ...])"
    if isinstance(layer, nn.RNNBase):
        return layer.input_size, "input features (its input's last dimension)"
    return None


def _raising_layer(exc: BaseException, model: Any) -> Any:
    """The innermost layer of ``model`` (of the kinds :func:`_expects` knows) whose ``forward``
    is in ``exc``'s traceback, or ``None``."""
    if model is None:
        return None
    ours = {id(m) for m in model.modules()}
    types = _layer_types()
    found = None
    tb = exc.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, types) and id(owner) in ours:
            found = owner
        tb = tb.tb_next
    return found


def _first_layer(model: Any) -> Any:
    if model is None:
        return None
    types = _layer_types()
    for module in model.modules():
        if isinstance(module, types) and _expects(module) is not None:
            return module
    return None


def _name(model: Any, layer: Any) -> str:
    for name, module in model.named_modules():
        if module is layer:
            return f"{name!r} = {layer}" if name else str(layer)
    return str(layer)  # pragma: no cover - a layer of the model, found among its modules


def _read_leaves(runner: Any, leaves: list[Any]) -> list[int]:
    """The observation leaves (their indices) ``runner``'s policy reads."""
    if hasattr(runner, "in_idx"):  # a module on tensors: the leaves it reads
        return list(runner.in_idx)
    # a TensorDict policy: the observation leaves among its in_keys (all of them if unknown)
    in_keys = {k if isinstance(k, tuple) else (k,) for k in getattr(getattr(runner, "policy", None), "in_keys", ()) or ()}
    return [i for i, leaf in enumerate(leaves) if leaf.key in in_keys] or list(range(len(leaves)))


def _fix(layer: Any, size: int, obs_shape: tuple[int, ...], first_raised: bool) -> str:
    """What to do about ``layer`` (which takes ``size``) given the one observation leaf the policy
    reads, of shape ``obs_shape`` (``()``: several leaves, or a scalar one: no particular advice);
    ``first_raised``: the layer is the policy's first (the one that raised, or none did)."""
    import torch

    fix = "build the policy for the env's observations"
    if not obs_shape:
        return fix
    if isinstance(layer, torch.nn.modules.conv._ConvNd):
        if len(obs_shape) == len(layer.kernel_size) + 1 and obs_shape[-1] == size and obs_shape[0] != size:
            return (
                f"the observation {obs_shape} looks channels-last: permute it to channels-first in the policy "
                f"(observation.movedim(-1, -{len(obs_shape)})) or with an env wrapper, or {fix}"
            )
        return fix + f" (in_channels={obs_shape[0]} for channels-first observations {obs_shape})"
    if len(obs_shape) == 1 and first_raised and size != obs_shape[0]:
        return fix + (f" ({type(layer).__name__} in_features={obs_shape[0]})" if isinstance(layer, torch.nn.Linear) else (
            f" (input_size={obs_shape[0]})"
        ))
    if len(obs_shape) > 1 and isinstance(layer, (torch.nn.Linear, torch.nn.RNNBase)):
        return fix + f" (flatten the observation {obs_shape} first, e.g. torch.nn.Flatten(), if it is an image)"
    return fix


def input_mismatch(exc: BaseException, runner: Any, obs: list[Any]) -> SpecError | None:
    """The :class:`SpecError` for ``exc``, raised by the first call of ``runner``'s policy on
    observations ``obs`` (one array per observation leaf, ``[rows, *shape]``), if it is a shape
    mismatch; else ``None`` (the caller re-raises ``exc``). The caller raises it ``from exc``."""
    if isinstance(exc, AiocollectError) or not isinstance(exc, (RuntimeError, ValueError)):
        return None
    if not _SHAPE_WORDS.search(str(exc)):
        return None  # (a dtype, a device, the policy's own error: not for this message)
    text = str(exc).strip().splitlines()[0]
    model = getattr(runner, "model", None)
    raising = _raising_layer(exc, model)
    leaves = runner.obs_leaves
    read = _read_leaves(runner, leaves)
    gives = ", ".join(
        f"the observation of shape {leaves[i].shape} per env ({leaves[i].dtype}; a batch {list(obs[i].shape)} "
        f"in that call)"
        for i in read
    )
    keys = [".".join(leaves[i].key) for i in read]
    named = f"key {keys[0]!r}" if len(keys) == 1 else f"keys {keys}"
    head = (
        f"the policy does not fit the env's observations: its first call failed with a shape mismatch "
        f"(torch: {text}); the policy's input {named} is {gives}"
    )
    first = _first_layer(model)
    layer = raising if raising is not None else first
    if layer is None or model is None:
        return SpecError(
            f"{head}; build the policy for these observation shapes, or give it an env whose observation space "
            f"is the one it was built for"
        )
    size, where = _expects(layer)  # type: ignore[misc]
    obs_shape = leaves[read[0]].shape
    if raising is not None and raising is first:
        what = f"its first layer, {_name(model, layer)}, expects {size} {where}"
    elif raising is not None:
        what = (
            f"the layer that raised, {_name(model, layer)}, expects {size} {where}; the policy's first layer is "
            f"{_name(model, first) if first is not None else 'unknown'}"
        )
    else:
        what = f"its first layer with a fixed input size, {_name(model, layer)}, takes {size} {where}"
    fix = _fix(layer, size, obs_shape if len(read) == 1 else (), raising is None or raising is first)
    return SpecError(f"{head}: {what}; {fix}, or give it an env whose observation space is the one it was built for")


__all__ = ["input_mismatch"]
