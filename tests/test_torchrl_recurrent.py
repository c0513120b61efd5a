"""TorchRL's recurrent modules collected by aiocollect: an ``LSTMModule`` policy built as
TorchRL's docs show (``LSTMModule(...)`` in a ``TensorDictSequential``; no primer transform: the
collector reads the module's primer and carries its state), whose stored batch replays in
recurrent mode (``set_recurrent_mode(True)``, as a trainer re-runs it) to the very outputs the
policy gave step by step during collection.

Runs only where TorchRL is installed (``bash scripts/torchrl-compat.sh tests/test_torchrl_recurrent.py``
runs it in ``.venv-torchrl``). The workers unpickle the policy, so they import torchrl too.
"""

from __future__ import annotations

import anyio
import pytest
import torch
from tensordict.nn import TensorDictModule, TensorDictSequential

torchrl = pytest.importorskip("torchrl")

from torchrl.modules import LSTMModule, set_recurrent_mode  # noqa: E402

from aiocollect import Collector  # noqa: E402

pytestmark = pytest.mark.timeout(120)
STATE_KEYS = ("recurrent_state_h", "recurrent_state_c")


class Argmax(torch.nn.Module):
    def forward(self, logits):
        return logits.argmax(-1)


def lstm_policy() -> TensorDictSequential:
    torch.manual_seed(0)
    lstm = LSTMModule(input_size=4, hidden_size=8, num_layers=2, in_key="observation", out_key="embed")
    head = TensorDictModule(torch.nn.Linear(8, 2), in_keys=["embed"], out_keys=["logits"])
    return TensorDictSequential(lstm, head, TensorDictModule(Argmax(), in_keys=["logits"], out_keys=["action"]))


@pytest.mark.parametrize("num_workers", [0, 1], ids=["local", "process"])
async def test_lstm_module_replays_our_batch_in_recurrent_mode(num_workers):
    """Two batches of CartPole (episodes start and end inside them, and one crosses the batch
    boundary): the batch holds is_init, the LSTM's states read and written, and TorchRL's
    recurrent mode on it gives the logits and next states stored step by step."""
    policy = lstm_policy()
    with anyio.fail_after(100):
        async with Collector("CartPole-v1", policy, frames_per_batch=128, num_workers=num_workers, envs_per_worker=2,
                             seed=3) as c:
            batches = [await c.collect() for _ in range(2)]
    for batch in batches:
        assert batch["is_init"].shape == (2, 64, 1) and batch["recurrent_state_h"].shape == (2, 64, 2, 8)
        assert batch["is_init"].any() and not batch["recurrent_state_c"][batch["is_init"][..., 0]].any()
        replay = batch.select("observation", "is_init", *STATE_KEYS).clone()
        with torch.no_grad(), set_recurrent_mode(True):
            policy(replay)
        torch.testing.assert_close(replay["logits"], batch["logits"], rtol=1e-4, atol=1e-5)
        for key in STATE_KEYS:  # (recurrent mode writes the next state at each sequence's last step only)
            torch.testing.assert_close(replay["next", key][:, -1], batch["next", key][:, -1], rtol=1e-4, atol=1e-5)
    first, second = batches  # (a trajectory crossing the batches carries its state)
    crossing = first["collector", "traj_ids"][:, -1] == second["collector", "traj_ids"][:, 0]
    assert crossing.any()
    for key in STATE_KEYS:
        torch.testing.assert_close(second[key][crossing, 0], first["next", key][crossing, -1])
