"""Reshape an ``[envs, time]`` batch into one padded row per trajectory (``split_trajs=True``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from tensordict import (
    NonTensorStack,
    TensorDict,
    TensorDictBase,
    is_leaf_nontensor,
    is_non_tensor,
    is_tensor_collection,
)

from .._core.errors import ConfigError, ConfigTypeError
from .._core.public import public

if TYPE_CHECKING:  # pragma: no cover - _layout imports gymnasium, which splitting does not need
    from .._core.layout import Key

__all__ = ["split_trajectories"]

_TRAJ_IDS: Key = ("collector", "traj_ids")
_MASK: Key = ("collector", "mask")
_NEXT_DONE: Key = ("next", "done")


@public
def split_trajectories(td: TensorDictBase) -> TensorDict:
    """Split a batch of consecutive frames into zero-padded trajectories.

    The input is a batch in the collector's layout, of shape ``[E, T]`` (one row of consecutive
    frames per env). A trajectory is a maximal run of frames within one row that share the same
    ``("collector", "traj_ids")``; a new trajectory also starts at the beginning of every row, so
    equal ids in two rows never merge. If the batch has no ``traj_ids``, a trajectory ends after
    each frame whose ``("next", "done")`` is set, and at the end of each row. A one-dimensional
    batch ``[T]`` is taken as a single row.

    Returns:
        A new :class:`~tensordict.TensorDict` of shape ``[n_traj, max_len]``, dimension names
        ``[None, "time"]``, on the input's device. Rows are the trajectories in the order of their
        first frame (by env row, then time), each left-aligned and padded at the end with zeros
        (``False`` for booleans), ``max_len`` being the longest trajectory. Every entry of the
        input is carried, nested ones and trailing dimensions included; tensors are copied, never
        views of the input, which is left unchanged. ``("collector", "mask")`` (bool,
        ``[n_traj, max_len]``) is ``True`` on real frames and ``False`` on padding. Non-tensor
        data holding one value for the whole batch is carried as is. An empty batch gives an
        empty ``[0, 0]`` result.

    Raises:
        ConfigError: (a ``ValueError``) the input already holds ``("collector", "mask")`` (it is
            already split), has more than two batch dimensions, or has neither
            ``("collector", "traj_ids")`` nor ``("next", "done")``.
        ConfigTypeError: (a ``ConfigError`` and a ``TypeError``) the input holds per-frame
            non-tensor data (a ``NonTensorStack``).

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> batch = TensorDict(
        ...     {"observation": torch.arange(8.0).view(2, 4),
        ...      ("collector", "traj_ids"): torch.tensor([[0, 0, 1, 1], [2, 3, 3, 3]])},
        ...     batch_size=[2, 4])
        >>> out = split_trajectories(batch)
        >>> out.batch_size
        torch.Size([4, 3])
        >>> out["observation"]
        tensor([[0., 1., 0.],
                [2., 3., 0.],
                [4., 0., 0.],
                [5., 6., 7.]])
        >>> out["collector", "mask"]
        tensor([[ True,  True, False],
                [ True,  True, False],
                [ True, False, False],
                [ True,  True,  True]])
    """
    if _MASK in td.keys(include_nested=True):
        raise ConfigError(
            'split_trajectories: the batch already has a ("collector", "mask") entry, so it is '
            "already split into trajectories (or padded by another layout); pass the unsplit "
            "[envs, time] batch instead"
        )
    if td.batch_dims == 1:
        td = td.unsqueeze(0)
    elif td.batch_dims != 2:
        raise ConfigError(
            f"split_trajectories: expected a batch of shape [envs, time], got batch_size "
            f"{tuple(td.batch_size)}; pass the collector's batch, or one env's row [time]"
        )
    num_rows, row_len = td.batch_size
    num_frames = num_rows * row_len
    device = td.device

    starts = _segment_starts(td, num_frames, row_len)
    if num_frames:
        # seg: trajectory index of each flat frame; pos: its index within the trajectory.
        seg = starts.cumsum(0) - 1
        start_index = starts.nonzero().squeeze(-1)
        pos = torch.arange(num_frames, device=starts.device) - start_index[seg]
        lengths = torch.diff(start_index, append=start_index.new_tensor([num_frames]))
        num_trajs = start_index.numel()
        max_len = int(lengths.max())
        dest = seg * max_len + pos
    else:
        num_trajs = max_len = 0
        dest = torch.zeros(0, dtype=torch.long, device=starts.device)

    out = TensorDict(batch_size=[num_trajs, max_len], device=device)
    for key, value in td.items(include_nested=True, leaves_only=True, is_leaf=is_leaf_nontensor):
        if is_non_tensor(value):
            if isinstance(value, NonTensorStack):
                raise ConfigTypeError(
                    f"split_trajectories: entry {key!r} holds per-frame non-tensor data, which "
                    f"cannot be padded; store it as a tensor or drop it before splitting (batch.exclude({key!r}))"
                )
            out.set_non_tensor(key, td.get_non_tensor(key))
            continue
        trailing = value.shape[2:]
        padded = torch.zeros(
            (num_trajs * max_len, *trailing), dtype=value.dtype, device=value.device
        )
        padded[dest.to(value.device)] = torch.as_tensor(value).reshape(num_frames, *trailing)
        out.set(key, padded.view(num_trajs, max_len, *trailing))
    # Sub-tensordicts with no leaves would otherwise be dropped.
    for key, value in td.items(include_nested=True):
        if is_tensor_collection(value) and not is_non_tensor(value) and key not in out.keys(True):
            out.set(key, TensorDict(batch_size=[num_trajs, max_len], device=device))

    mask = torch.zeros(num_trajs * max_len, dtype=torch.bool, device=dest.device)
    mask[dest] = True
    out.set(_MASK, mask.view(num_trajs, max_len))
    out.names = [None, "time"]
    return out


def _segment_starts(td: TensorDictBase, num_frames: int, row_len: int) -> torch.Tensor:
    """Bool ``[E*T]``: True on the first frame of each trajectory."""
    if num_frames == 0:
        return torch.zeros(0, dtype=torch.bool, device=td.device)
    traj_ids = td.get(_TRAJ_IDS, None)
    if traj_ids is not None:
        flat = traj_ids.reshape(num_frames)
        starts = torch.ones(num_frames, dtype=torch.bool, device=flat.device)
        starts[1:] = flat[1:] != flat[:-1]
    else:
        done = td.get(_NEXT_DONE, None)
        if done is None:
            raise ConfigError(
                'split_trajectories: the batch has neither ("collector", "traj_ids") nor '
                '("next", "done"), so trajectories cannot be told apart; pass a batch that holds '
                "either (the collector's batches hold both)"
            )
        flat = done.reshape(num_frames, -1).any(-1)  # a frame is done if any of its flags is
        starts = torch.ones(num_frames, dtype=torch.bool, device=flat.device)
        starts[1:] = flat[:-1]
    starts[::row_len] = True
    return starts
