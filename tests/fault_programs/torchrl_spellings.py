"""A TorchRL script's loop as its author wrote it, on aiocollect: TorchRL's argument spellings
(device="cpu", storing_device, env_device, policy_device, max_frames_per_traj=-1,
init_random_frames=-1, total_frames=-1), `for data in collector.iterator()`, `data.device`,
`update_policy_weights_()`, `break`, then `collector.shutdown()`; then the same loop with a worker
SIGKILLed mid-run, which must end in an error naming the worker, and `shutdown()` that still
closes. Episodes (CartPole, a balancing policy) run much longer than a batch: each env row's
trajectory id holds across batches until its episode ends. Exits 0 with a last line 'ok: ...'."""

import os
import signal
import sys

import torch

from aiocollect import AiocollectError, Collector, CollectorState


class Balance(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gain = torch.nn.Parameter(torch.ones(()))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return ((obs[..., 2] + 0.5 * obs[..., 3]) * self.gain > 0).long()


def fail(why: str) -> None:
    print(f"FAILED: {why}", file=sys.stderr)
    sys.exit(1)


def make(**extra) -> Collector:
    return Collector(create_env_fn="CartPole-v1", policy=Balance(), frames_per_batch=32, total_frames=-1,
                     num_workers=2, envs_per_worker=2, device="cpu", storing_device="cpu", env_device="cpu",
                     policy_device="cpu", max_frames_per_traj=-1, init_random_frames=-1, split_trajs=False,
                     reset_at_each_iter=False, exploration_type="deterministic", seed=0, **extra)


def torchrl_loop() -> int:
    collector = make()
    last_ids = None
    crossed = 0
    for i, data in enumerate(collector.iterator()):
        if data.device != torch.device("cpu") or data.device.type != "cpu":
            fail(f"data.device is {data.device!r}, TorchRL gives device(type='cpu')")
        if data.batch_size != torch.Size([4, 8]) or "step_count" in data.keys():
            fail(f"batch {tuple(data.batch_size)} with keys {sorted(data.keys())}")
        ids, done = data["collector", "traj_ids"], data["next", "done"][..., 0]
        for row in range(4):  # row by row: an id changes only after a done
            changes = (ids[row, 1:] != ids[row, :-1]).nonzero().flatten()
            if not all(bool(done[row, t]) for t in changes):
                fail(f"row {row}: trajectory id changed without an episode end: {ids[row].tolist()}")
            if last_ids is not None and not bool(data["done"][row, 0]) and ids[row, 0] == last_ids[row]:
                crossed += 1
        last_ids = ids[:, -1].clone()
        collector.update_policy_weights_()
        if i == 9:
            break
    collector.shutdown()
    collector.shutdown()  # twice is fine
    if collector.state is not CollectorState.CLOSED:
        fail(f"after shutdown() the collector is {collector.state}")
    if crossed == 0:
        fail("no trajectory kept its id across a batch boundary")
    return crossed


def killed_worker() -> str:
    collector = make()
    error = None
    try:
        for i, data in enumerate(collector.iterator()):
            if i == 1:
                os.kill(collector.worker_pids[1], signal.SIGKILL)
            if i == 1000:
                fail("collection went on for 1000 batches after a worker was killed")
    except AiocollectError as exc:
        error = exc
    finally:
        collector.shutdown()
    if error is None or "worker 1" not in str(error):
        fail(f"a killed worker ended the loop with {error!r}, which does not name worker 1")
    return type(error).__name__


def main() -> None:
    crossed = torchrl_loop()
    error = killed_worker()
    print(f"ok: TorchRL's spellings ran as written, data.device cpu, {crossed} trajectories kept their id across "
          f"batches, a SIGKILLed worker ended iterator() with {error} and shutdown() closed")


if __name__ == "__main__":
    main()
