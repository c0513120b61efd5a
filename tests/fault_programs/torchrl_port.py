"""A TorchRL 0.14 training script ported to aiocollect as it is: TorchRL's argument names
(frames_per_batch, total_frames, max_frames_per_traj, traj_format="padded"), a one-hot policy
(TorchRL GymEnv's default action encoding), update_policy_weights_ in a plain for loop, and the
Evaluator's TorchRL names (blocking evaluate, trigger_eval, wait, shutdown, log_prefix).
Exits 0 with a last line 'ok: ...' when every TorchRL convention held."""

import asyncio
import sys

import torch
from tensordict.nn import TensorDictModule

from aiocollect import Collector, Evaluator


class Actor(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 2)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.one_hot(self.net(obs).argmax(-1), 2)


def fail(why: str) -> None:
    print(f"FAILED: {why}", file=sys.stderr)
    sys.exit(1)


def training_script(policy: TensorDictModule) -> int:
    """TorchRL's shape: a blocking collector, weights pushed after each batch."""
    batches = 0
    with Collector("CartPole-v1", policy, frames_per_batch=64, total_frames=64 * 4, num_workers=2,
                   envs_per_worker=2, max_frames_per_traj=20, categorical_action_encoding=False, seed=0) as collector:
        for batch in collector:
            if batch.batch_size != torch.Size([4, 16]):
                fail(f"batch size {tuple(batch.batch_size)}, expected (4, 16)")
            if batch["action"].shape != torch.Size([4, 16, 2]) or not (batch["action"].sum(-1) == 1).all():
                fail("actions are not stored one-hot [E, T, 2]")
            sc, nsc = batch["step_count"], batch["next", "step_count"]
            if sc.shape != torch.Size([4, 16, 1]) or not torch.equal(nsc, sc + 1) or int(nsc.max()) > 20:
                fail(f"step_count wrong: {sc[..., 0].tolist()}")
            with torch.no_grad():
                policy.module.net.weight.add_(0.01)
            collector.update_policy_weights_(policy)
            batches += 1
    return batches


def trajectories(policy: TensorDictModule) -> int:
    with Collector("CartPole-v1", policy, frames_per_batch=64, total_frames=64 * 2, num_workers=1,
                   envs_per_worker=4, max_frames_per_traj=20, trajs_per_batch=3, traj_format="padded",
                   categorical_action_encoding=False, seed=0) as collector:
        if collector.config.traj_format != "pad":
            fail(f"traj_format='padded' became {collector.config.traj_format!r}")
        batch = next(iter(collector))
    if batch.batch_size[0] != 3 or not batch["collector", "mask"][:, 0].all():
        fail(f"padded trajectories have batch size {tuple(batch.batch_size)}")
    return int(batch["collector", "mask"].sum())


def blocking_evaluator(policy: TensorDictModule) -> dict:
    evaluator = Evaluator("CartPole-v1", policy, num_trajectories=4, max_steps=50, log_prefix="eval", seed=0,
                          categorical_action_encoding=False)
    try:
        metrics = evaluator.evaluate(policy, step=0)  # blocking, as TorchRL's
        if not {"eval/reward", "eval/reward_std", "eval/episode_length", "eval/num_episodes"} <= set(metrics):
            fail(f"TorchRL metric names missing: {sorted(metrics)}")
        if not evaluator.trigger_eval(policy, step=1):
            fail("trigger_eval did not schedule")
        later = evaluator.wait()
        if later is None or later["eval/step"] != 1:
            fail(f"wait() gave {later}")
    finally:
        evaluator.shutdown()
    return metrics


async def async_evaluator(policy: TensorDictModule, expected: float) -> None:
    evaluator = Evaluator("CartPole-v1", policy, num_trajectories=4, max_steps=50, log_prefix="eval", seed=0,
                          categorical_action_encoding=False)
    try:
        metrics = await evaluator.evaluate(policy, step=0)
        if metrics["eval/reward"] != expected:
            fail(f"async evaluate gave {metrics['eval/reward']}, blocking {expected} (same seed and weights)")
        evaluator.trigger_eval(policy, step=1)
        await evaluator.wait()
    finally:
        await evaluator.shutdown()


def main() -> None:
    torch.manual_seed(0)
    policy = TensorDictModule(Actor(), in_keys=["observation"], out_keys=["action"])
    batches = training_script(policy)
    frames = trajectories(policy)
    metrics = blocking_evaluator(policy)
    asyncio.run(async_evaluator(policy, metrics["eval/reward"]))
    print(f"ok: {batches} one-hot batches with step_count, {frames} frames of padded trajectories, "
          f"TorchRL's Evaluator names blocking and async (eval/reward {metrics['eval/reward']:.1f})")


if __name__ == "__main__":
    main()
