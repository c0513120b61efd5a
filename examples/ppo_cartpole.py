"""PPO on CartPole-v1, trained on aiocollect batches: one file, in cleanrl's style.

    .venv/bin/python examples/ppo_cartpole.py --plot ppo.png --target 475   # the full run: 409,600 frames
    .venv/bin/python examples/ppo_cartpole.py --short                       # CI's short run: 32,768 frames
    .venv-torchrl/bin/python examples/ppo_cartpole.py --torchrl             # TorchRL's ClipPPOLoss and GAE
    .venv/bin/python examples/ppo_cartpole.py --help                        # every option

The actor runs in the collector's worker processes (2 workers x 4 envs by default) and writes
the log-probability of each action it samples into the batch; the critic stays here. Each batch
(a TensorDict ``[envs, time]``) gets GAE advantages, then a few epochs of clipped PPO updates on
shuffled minibatches, then ``await collector.update_weights(actor)`` publishes the new actor
weights, which the workers apply before they collect the next batch (``prefetch=0``: every batch
comes from the newest weights, PPO is on-policy). Episode returns come from the collector's
``EpisodeEnded`` events (computed in the workers). At the end: the mean return of the last
``--return-window`` training episodes, a greedy evaluation of the final actor by an
``aiocollect.Evaluator``, the wall time, and, with ``--target``, exit status 1 if the mean
return stayed below it.

``--torchrl`` replaces the hand-written GAE and loss by TorchRL's ``GAE`` and ``ClipPPOLoss`` on
the same batches (they find the time dim by its name and read the same keys).

The recipe page, with a full run's output and learning curve: docs/recipes/ppo.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time

LAUNCHED = time.perf_counter()  # before the heavy imports: the wall time printed at the end includes them

from collections.abc import Callable, Sequence
from typing import TypeVar

import anyio
import gymnasium as gym
import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import ProbabilisticTensorDictModule, ProbabilisticTensorDictSequential, TensorDictModule
from torch import nn

from aiocollect import Collector, Evaluator
from aiocollect.events import EpisodeEnded

_T = TypeVar("_T")


def opt(default: _T, help: str) -> _T:
    """A config field with its command-line help attached (turned into ``--flag`` by
    :func:`parse_config`)."""
    return dataclasses.field(default=default, metadata={"help": help})  # type: ignore[no-any-return]


@dataclasses.dataclass
class Config:
    """Every option of the run; each field is a command-line flag (``total_frames`` ->
    ``--total-frames``)."""

    env_id: str = opt("CartPole-v1", "gymnasium id (a Box observation and Discrete actions)")
    seed: int = opt(1, "seed of the envs, the network initialisation and the minibatch shuffles")
    total_frames: int = opt(409_600, "environment frames to collect in all (a multiple of frames_per_batch)")
    num_workers: int = opt(2, "worker processes stepping envs")
    envs_per_worker: int = opt(4, "envs in each worker")
    frames_per_batch: int = opt(1024, "frames per batch (envs x steps per env)")
    learning_rate: float = opt(1e-3, "Adam's learning rate at the start")
    anneal_lr: bool = opt(True, "decay the learning rate linearly to 0 over the run")
    gamma: float = opt(0.99, "discount factor")
    gae_lambda: float = opt(0.95, "GAE's lambda")
    update_epochs: int = opt(4, "passes over each batch")
    num_minibatches: int = opt(4, "minibatches per pass")
    clip_coef: float = opt(0.2, "PPO's clipping of the probability ratio")
    ent_coef: float = opt(0.01, "weight of the entropy bonus")
    vf_coef: float = opt(0.5, "weight of the value loss (squared error)")
    max_grad_norm: float = opt(0.5, "gradient clipping (global norm)")
    hidden: int = opt(64, "units in each of the two hidden layers of the actor and the critic")
    torchrl: bool = opt(False, "use TorchRL's GAE and ClipPPOLoss instead of the hand-written ones")
    log_every: int = opt(20_480, "print a progress line every this many frames")
    return_window: int = opt(100, "the final mean return is over this many last training episodes")
    eval_episodes: int = opt(10, "episodes of the final greedy evaluation (0: none)")
    target: float | None = opt(None, "exit with status 1 if the final mean return is below this")
    plot: str | None = opt(None, "write the learning curve to this PNG file (needs matplotlib)")
    torch_threads: int = opt(1, "torch threads of the learner (the workers use the other cores)")

    def __post_init__(self) -> None:
        envs = self.num_workers * self.envs_per_worker
        if self.frames_per_batch % envs:
            raise ValueError(f"frames_per_batch={self.frames_per_batch} is not a multiple of the "
                             f"{envs} envs (num_workers x envs_per_worker); pass a multiple")
        if self.total_frames % self.frames_per_batch:
            raise ValueError(f"total_frames={self.total_frames} is not a multiple of "
                             f"frames_per_batch={self.frames_per_batch}; pass a multiple")
        if self.frames_per_batch % self.num_minibatches:
            raise ValueError(f"frames_per_batch={self.frames_per_batch} is not a multiple of "
                             f"num_minibatches={self.num_minibatches}; pass a divisor")


SHORT = {"total_frames": 32_768, "log_every": 4096, "eval_episodes": 3, "return_window": 20}
"""``--short``: CI's preset (its options can still be overridden by flags)."""


def parse_config(argv: Sequence[str] | None = None) -> Config:
    """The config from the command line: one flag per :class:`Config` field, and ``--short``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--short", action="store_true",
                        help=f"a short run for CI: {', '.join(f'{k}={v}' for k, v in SHORT.items())}")
    for f in dataclasses.fields(Config):
        flag = "--" + f.name.replace("_", "-")
        if isinstance(f.default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default,
                                help=f.metadata["help"])
        else:
            kind = {"target": float, "plot": str}.get(f.name, type(f.default))
            parser.add_argument(flag, type=kind, default=f.default, help=f.metadata["help"])
    if "--short" in (sys.argv[1:] if argv is None else argv):
        parser.set_defaults(**SHORT)
    args = vars(parser.parse_args(argv))
    del args["short"]
    try:
        return Config(**args)
    except ValueError as exc:
        parser.error(str(exc))


# -- the models ---------------------------------------------------------------------------------


def layer_init(layer: nn.Linear, std: float = math.sqrt(2)) -> nn.Linear:
    """cleanrl's initialisation: orthogonal weights, zero biases."""
    nn.init.orthogonal_(layer.weight, std)
    nn.init.zeros_(layer.bias)
    return layer


def make_models(cfg: Config, obs_dim: int, n_actions: int) -> tuple[ProbabilisticTensorDictSequential, TensorDictModule]:
    """The actor (observation -> logits -> sampled action and its log-prob: what the workers run)
    and the critic (observation -> state_value: it stays in this process).

    Built from torch and tensordict classes only, so that the workers unpickle the actor without
    importing this file."""
    h = cfg.hidden
    actor_net = nn.Sequential(layer_init(nn.Linear(obs_dim, h)), nn.Tanh(), layer_init(nn.Linear(h, h)), nn.Tanh(),
                              layer_init(nn.Linear(h, n_actions), std=0.01))
    critic_net = nn.Sequential(layer_init(nn.Linear(obs_dim, h)), nn.Tanh(), layer_init(nn.Linear(h, h)), nn.Tanh(),
                               layer_init(nn.Linear(h, 1), std=1.0))
    actor = ProbabilisticTensorDictSequential(
        TensorDictModule(actor_net, in_keys=["observation"], out_keys=["logits"]),
        ProbabilisticTensorDictModule(in_keys=["logits"], out_keys=["action"],
                                      distribution_class=torch.distributions.Categorical, return_log_prob=True),
    )
    critic = TensorDictModule(critic_net, in_keys=["observation"], out_keys=["state_value"])
    return actor, critic


# -- GAE and the loss, by hand --------------------------------------------------------------------


def gae(batch: TensorDictBase, critic: TensorDictModule, gamma: float, lmbda: float) -> TensorDictBase:
    """Writes ``advantage`` and ``value_target`` (``[envs, time, 1]``, as TorchRL's GAE does)
    into an ``[envs, time]`` batch and returns it.

    Each env row is a sequence in time order; an episode ends inside it at ``("next", "done")``.
    The one-step error bootstraps from the value of ``("next", "observation")`` (the true final
    observation at an episode end) unless the episode *terminated*: a truncated episode
    (CartPole's 500-step limit) still had a future. The trace is cut at every episode end, and
    the row's last frame, whose episode goes on in the next batch, bootstraps with a trace of 0.
    """
    with torch.no_grad():
        value = critic.module(batch["observation"])
        next_value = critic.module(batch["next", "observation"])
    reward = batch["next", "reward"]
    not_terminated = (~batch["next", "terminated"]).float()
    not_done = (~batch["next", "done"]).float()
    delta = reward + gamma * not_terminated * next_value - value
    advantage = torch.zeros_like(delta)
    running = torch.zeros_like(delta[:, 0])
    for t in reversed(range(batch.shape[1])):  # dim 1 is "time"
        running = delta[:, t] + gamma * lmbda * not_done[:, t] * running
        advantage[:, t] = running
    batch["advantage"] = advantage
    batch["value_target"] = advantage + value
    return batch


class PPOLoss(nn.Module):
    """The clipped PPO loss by hand, with the keys and terms of TorchRL's ``ClipPPOLoss``: reads
    ``observation``, ``action``, ``action_log_prob`` (written by the actor in the workers),
    ``advantage`` and ``value_target``; returns ``loss_objective``, ``loss_critic`` and
    ``loss_entropy`` (each already weighted: the total loss is their sum)."""

    def __init__(self, actor: ProbabilisticTensorDictSequential, critic: TensorDictModule, cfg: Config) -> None:
        super().__init__()
        self.actor, self.critic, self.cfg = actor, critic, cfg

    def forward(self, mb: TensorDictBase) -> TensorDict:
        cfg = self.cfg
        dist = self.actor.get_dist(mb)  # the Categorical of the current weights, from mb["observation"]
        log_ratio = dist.log_prob(mb["action"]) - mb["action_log_prob"]
        ratio = log_ratio.exp()
        advantage = mb["advantage"].squeeze(-1)
        advantage = (advantage - advantage.mean()) / (advantage.std() + 1e-8)  # per minibatch
        objective = torch.min(ratio * advantage, ratio.clamp(1 - cfg.clip_coef, 1 + cfg.clip_coef) * advantage)
        value = self.critic.module(mb["observation"])
        return TensorDict(
            loss_objective=-objective.mean(),
            loss_critic=cfg.vf_coef * (value - mb["value_target"]).pow(2).mean(),
            loss_entropy=-cfg.ent_coef * dist.entropy().mean(),
            kl_approx=((ratio - 1) - log_ratio).mean().detach(),  # http://joschu.net/blog/kl-approx.html
        )


# -- or TorchRL's --------------------------------------------------------------------------------


def torchrl_objectives(
    actor: ProbabilisticTensorDictSequential, critic: TensorDictModule, cfg: Config
) -> tuple[Callable[[TensorDictBase], TensorDictBase], nn.Module]:
    """TorchRL's ``GAE`` and ``ClipPPOLoss``, set up as the hand-written ones are."""
    try:
        from torchrl.objectives import ClipPPOLoss
        from torchrl.objectives.value import GAE
    except ImportError as exc:
        raise SystemExit(
            f"--torchrl needs TorchRL, which is not installed here ({exc}). Install it beside aiocollect "
            "(pip install torchrl; TorchRL 0.14 wants tensordict<0.15), or use the environment that "
            "`bash scripts/torchrl-compat.sh setup` builds: .venv-torchrl/bin/python examples/ppo_cartpole.py --torchrl"
        ) from exc
    advantage = GAE(gamma=cfg.gamma, lmbda=cfg.gae_lambda, value_network=critic)
    loss = ClipPPOLoss(actor, critic, clip_epsilon=cfg.clip_coef, entropy_coeff=cfg.ent_coef,
                       critic_coeff=cfg.vf_coef, loss_critic_type="l2", normalize_advantage=True)
    return advantage, loss


# -- training --------------------------------------------------------------------------------------


def ppo_update(cfg: Config, data: TensorDictBase, loss_module: nn.Module, optimizer: torch.optim.Optimizer,
               params: list[nn.Parameter]) -> dict[str, float]:
    """``update_epochs`` passes of minibatch steps over the frames of one batch (flattened);
    returns the last minibatch's loss terms."""
    data = data.reshape(-1)
    minibatch = data.numel() // cfg.num_minibatches
    for _ in range(cfg.update_epochs):
        for index in torch.randperm(data.numel()).split(minibatch):
            terms = loss_module(data[index])
            loss = sum(terms[key] for key in terms.keys() if key.startswith("loss_"))
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
            optimizer.step()
    return {key: float(value.detach()) for key, value in terms.items() if key.startswith(("loss_", "kl_approx"))}


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


async def train(cfg: Config) -> int:
    """Runs the training; returns the exit status (1: ``cfg.target`` not reached)."""
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.torch_threads)
    env = gym.make(cfg.env_id)
    if not (isinstance(env.observation_space, gym.spaces.Box) and isinstance(env.action_space, gym.spaces.Discrete)):
        raise SystemExit(f"--env-id {cfg.env_id}: this PPO needs a Box observation space and a Discrete action space, "
                         f"not {env.observation_space} and {env.action_space}; pick another env")
    actor, critic = make_models(cfg, env.observation_space.shape[0], int(env.action_space.n))
    env.close()
    if cfg.torchrl:
        advantage_module, loss_module = torchrl_objectives(actor, critic, cfg)
    else:
        advantage_module = lambda batch: gae(batch, critic, cfg.gamma, cfg.gae_lambda)  # noqa: E731
        loss_module = PPOLoss(actor, critic, cfg)
    if cfg.plot:
        check_matplotlib()  # before training, not after
    params = [*actor.parameters(), *critic.parameters()]
    optimizer = torch.optim.Adam(params, lr=cfg.learning_rate, eps=1e-5)
    num_updates = cfg.total_frames // cfg.frames_per_batch

    # PPO is on-policy: prefetch=0 (with the default delivery="sync") makes every frame of the next
    # batch come from the weights published by update_weights() after the previous one
    collector = Collector(cfg.env_id, actor, frames_per_batch=cfg.frames_per_batch, total_frames=cfg.total_frames,
                          num_workers=cfg.num_workers, envs_per_worker=cfg.envs_per_worker,
                          exploration_type="random", prefetch=0, seed=cfg.seed)
    episodes: list[tuple[int, float]] = []  # (frames collected when it was reported, return)
    collector.on(EpisodeEnded, lambda e: episodes.append((collector.frames, e.ret)))

    print(f"PPO on {cfg.env_id}: {cfg.num_workers} workers x {cfg.envs_per_worker} envs, "
          f"{cfg.frames_per_batch} frames per batch, {num_updates} updates, "
          f"{'TorchRL GAE + ClipPPOLoss' if cfg.torchrl else 'hand-written GAE + loss'}", flush=True)
    logged_episodes, next_log = 0, cfg.log_every
    async with collector:
        collect_start = time.perf_counter()
        async for batch in collector:
            if cfg.anneal_lr:
                optimizer.param_groups[0]["lr"] = cfg.learning_rate * (1 - (collector.batches - 1) / num_updates)
            terms = ppo_update(cfg, advantage_module(batch), loss_module, optimizer, params)
            await collector.update_weights(actor)
            frames = collector.frames
            if frames >= next_log or frames >= cfg.total_frames:
                next_log += cfg.log_every
                new = [ret for _, ret in episodes[logged_episodes:]]
                logged_episodes = len(episodes)
                recent = [ret for _, ret in episodes[-cfg.return_window:]]
                print(f"frames {frames:>8}  fps {frames / (time.perf_counter() - collect_start):7.0f}  "
                      f"episodes {len(new):4d}  mean return {mean(new):6.1f}  "
                      f"(last {len(recent)}: {mean(recent):6.1f})  "
                      f"value loss {terms['loss_critic']:8.3g}  kl {terms['kl_approx']:.4f}", flush=True)
    loop_seconds = time.perf_counter() - collect_start
    final = mean([ret for _, ret in episodes[-cfg.return_window:]])
    print(f"final mean return {final:.1f} (last {min(cfg.return_window, len(episodes))} of {len(episodes)} "
          f"training episodes), {collector.frames} frames, wall time {time.perf_counter() - LAUNCHED:.1f} s "
          f"since launch (training loop {loop_seconds:.1f} s)", flush=True)

    if cfg.eval_episodes:
        async with Evaluator(cfg.env_id, actor, num_trajectories=cfg.eval_episodes, seed=cfg.seed + 10_000) as evaluator:
            metrics = await evaluator.evaluate(actor)  # greedy: the most likely action
        print(f"greedy evaluation of the final actor: return_mean {metrics['return_mean']:.1f} "
              f"(min {metrics['return_min']:.0f}, max {metrics['return_max']:.0f}) over {cfg.eval_episodes} episodes")
    if cfg.plot:
        save_curve(cfg, cfg.plot, episodes)
        print(f"learning curve written to {cfg.plot}")
    if cfg.target is not None and not final >= cfg.target:
        print(f"target not reached: final mean return {final:.1f} < {cfg.target}", file=sys.stderr)
        return 1
    return 0


# -- the learning curve ------------------------------------------------------------------------------


def check_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise SystemExit(f"--plot needs matplotlib ({exc}): pip install 'aiocollect[plots]' "
                         "(or pip install matplotlib), or leave --plot out") from exc


def save_curve(cfg: Config, path: str, episodes: list[tuple[int, float]]) -> None:
    """Each training episode's return (dots) and the mean of the last ``return_window`` (line)
    against the frames collected."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    frames = [f for f, _ in episodes]
    returns = [r for _, r in episodes]
    window = [mean(returns[max(0, i + 1 - cfg.return_window): i + 1]) for i in range(len(returns))]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.scatter(frames, returns, s=2, alpha=0.25, color="tab:blue", label="episode return")
    ax.plot(frames, window, color="tab:blue", linewidth=2, label=f"mean of the last {cfg.return_window}")
    if cfg.target is not None:
        ax.axhline(cfg.target, color="tab:red", linestyle="--", linewidth=1, label=f"target {cfg.target:g}")
    ax.set_xlabel("frames collected")
    ax.set_ylabel("return")
    ax.set_title(f"PPO on {cfg.env_id} ({'TorchRL loss' if cfg.torchrl else 'hand-written loss'}), "
                 f"{cfg.num_workers} workers x {cfg.envs_per_worker} envs")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    """Parses the command line, trains; returns the exit status."""
    return anyio.run(train, parse_config(argv))


if __name__ == "__main__":
    sys.exit(main())
