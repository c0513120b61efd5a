"""Devices, as TorchRL's collectors name them: ``device`` (fills the others), ``policy_device``,
``env_device`` and ``storing_device``. Checked at construction; torch is imported only when one
is given, and CUDA is asked about only when a CUDA device is."""

from __future__ import annotations

from typing import Any

from .._core.errors import ConfigError

_NAMES = ("device", "policy_device", "env_device", "storing_device")


def _as_device(name: str, value: Any) -> Any:
    """``value`` as a ``torch.device`` (a CUDA one only where CUDA is there; never for the envs)."""
    if value is None:
        return None
    import torch

    if not isinstance(value, (str, torch.device)):
        raise ConfigError(f"{name}={value!r} must be a device: 'cpu', 'cuda', 'cuda:1', a torch.device, or None")
    try:
        device = torch.device(value)
    except RuntimeError as exc:
        raise ConfigError(f"{name}={value!r} is not a device torch knows ({exc})") from None
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"{name}={value!r}: aiocollect supports 'cpu' and 'cuda' devices")
    if device.type == "cuda" and name == "env_device":
        raise ConfigError(
            f"env_device={value!r}: gymnasium envs step on the CPU (their observations are numpy arrays); leave "
            f"env_device=None or 'cpu' (storing_device='cuda' puts batches on the GPU)"
        )
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"{name}={value!r} but CUDA is not available here (torch {torch.__version__}, "
                f"torch.cuda.is_available() is False); use 'cpu' or a machine with a CUDA GPU and a CUDA build of torch"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"{name}={value!r} but this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def resolve_devices(config: Any) -> dict[str, Any]:
    """The four devices of ``config``, as ``torch.device`` or ``None``: ``device`` fills
    ``policy_device`` and ``storing_device`` where they are not given (the envs are gymnasium's:
    always on the CPU). Raises :class:`ConfigError` for what cannot work."""
    given = {name: _as_device(name, getattr(config, name)) for name in _NAMES}
    device = given["device"]
    env = given["env_device"]
    policy = given["policy_device"] or device
    storing = given["storing_device"] or device
    if policy is not None and policy.type == "cuda" and config.inference != "server":
        raise ConfigError(
            f"policy_device={str(policy)!r} with inference='worker': worker inference runs a copy of the policy in "
            f"each worker process, on the CPU; use inference='server' to run it on the GPU in this process, or "
            f"policy_device='cpu'"
        )
    if storing is not None and storing.type == "cuda" and config.zero_copy:
        raise ConfigError(
            f"storing_device={str(storing)!r} with zero_copy={config.zero_copy!r}: zero-copy batches are views on "
            f"the workers' shared memory, on the CPU; drop zero_copy (a CUDA batch is copied there once)"
        )
    return {"policy_device": policy, "env_device": env, "storing_device": storing}


__all__ = ["resolve_devices"]
