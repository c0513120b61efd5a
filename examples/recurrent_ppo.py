"""Recurrent PPO on CartPole-v1 with the velocities hidden, trained on aiocollect batches.

    .venv/bin/python examples/recurrent_ppo.py --target 300          # the full run: 163,840 frames
    .venv/bin/python examples/recurrent_ppo.py --short               # CI's short run
    .venv/bin/python examples/recurrent_ppo.py --no-memory           # the same GRU, its state zeroed every step
    .venv/bin/python examples/recurrent_ppo.py --help                # every option

The env shows only the cart's position and the pole's angle (a ``gymnasium.ObservationWrapper``):
the velocities must be inferred from what came before, so the policy needs a memory. The actor is
a GRU in a ``TensorDictModule`` that reads ``observation``, ``is_init`` and ``recurrent_state`` and
writes ``("next", "recurrent_state")``; the collector is told the state's shape
(``recurrent_state={"recurrent_state": (1, hidden)}``), carries it from step to step in its
workers, zeroes it at every episode start, and stores it in the batch beside ``is_init``.

Training, in cleanrl's recurrent-PPO style, with torch and tensordict only: each env row of a batch
``[envs, time]`` is cut into chunks of ``--seq-len`` steps; the GRU is re-run over each chunk from
the state the batch stores at the chunk's first step, zeroed wherever ``is_init`` is True, exactly
as the workers ran it. GAE runs over the rows, then a few epochs of clipped PPO on minibatches of
chunks, then ``await collector.update_weights(actor)``. Before the first update of each batch the
replayed log-probabilities are compared with those the workers stored (``action_log_prob``); the
largest difference is printed ("replay error"): it stays at float rounding when the state handling
is right. At the end: the mean return of the last ``--return-window`` episodes, the wall time and,
with ``--target``, exit status 1 if the mean return stayed below it.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time

LAUNCHED = time.perf_counter()  # before the heavy imports: the wall time printed at the end includes them

from collections.abc import Sequence
from typing import TypeVar

import anyio
import gymnasium as gym
import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import ProbabilisticTensorDictModule, ProbabilisticTensorDictSequential, TensorDictModule
from torch import nn

from aiocollect import Collector
from aiocollect.events import EpisodeEnded

_T = TypeVar("_T")
STATE = "recurrent_state"  # the state's key in the batch: TorchRL's name for a GRU's hidden state


def opt(default: _T, help: str) -> _T:
    """A config field with its command-line help attached (turned into ``--flag`` by
    :func:`parse_config`)."""
    return dataclasses.field(default=default, metadata={"help": help})  # type: ignore[no-any-return]


@dataclasses.dataclass
class Config:
    """Every option of the run; each field is a command-line flag (``seq_len`` -> ``--seq-len``)."""

    seed: int = opt(1, "seed of the envs, the network initialisation and the minibatch shuffles")
    frames: int = opt(163_840, "environment frames to collect in all (a multiple of frames_per_batch)")
    num_workers: int = opt(2, "worker processes stepping envs")
    envs_per_worker: int = opt(4, "envs in each worker")
    frames_per_batch: int = opt(1024, "frames per batch (envs x steps per env)")
    seq_len: int = opt(16, "steps per training sequence (each env row of a batch is cut into chunks of this length)")
    hidden: int = opt(64, "units of the observation encoder and of the GRU's state")
    memory: bool = opt(True, "carry the GRU's state from step to step (--no-memory: zeroed every step)")
    learning_rate: float = opt(2.5e-3, "Adam's learning rate at the start")
    anneal_lr: bool = opt(True, "decay the learning rate linearly to 0 over the run")
    gamma: float = opt(0.99, "discount factor")
    gae_lambda: float = opt(0.95, "GAE's lambda")
    update_epochs: int = opt(4, "passes over each batch")
    num_minibatches: int = opt(4, "minibatches (of whole chunks) per pass")
    clip_coef: float = opt(0.2, "PPO's clipping of the probability ratio")
    ent_coef: float = opt(0.01, "weight of the entropy bonus")
    vf_coef: float = opt(0.5, "weight of the value loss (squared error)")
    max_grad_norm: float = opt(0.5, "gradient clipping (global norm)")
    reward_scale: float = opt(0.1, "rewards are multiplied by this for the critic (values near 1: the value loss, "
                                   "whose gradient shares the GRU with the actor's, does not drown the actor's)")
    log_every: int = opt(20_480, "print a progress line every this many frames")
    return_window: int = opt(100, "the final mean return is over this many last training episodes")
    target: float | None = opt(None, "exit with status 1 if the final mean return is below this")
    torch_threads: int = opt(1, "torch threads of the learner (the workers use the other cores)")

    def __post_init__(self) -> None:
        envs = self.num_workers * self.envs_per_worker
        if self.frames_per_batch % envs:
            raise ValueError(f"frames_per_batch={self.frames_per_batch} is not a multiple of the "
                             f"{envs} envs (num_workers x envs_per_worker); pass a multiple")
        if self.frames % self.frames_per_batch:
            raise ValueError(f"frames={self.frames} is not a multiple of frames_per_batch={self.frames_per_batch}; "
                             "pass a multiple")
        if (self.frames_per_batch // envs) % self.seq_len:
            raise ValueError(f"seq_len={self.seq_len} does not divide the {self.frames_per_batch // envs} steps per "
                             "env of a batch (frames_per_batch / envs); pass a divisor")
        if (self.frames_per_batch // self.seq_len) % self.num_minibatches:
            raise ValueError(f"num_minibatches={self.num_minibatches} does not divide the "
                             f"{self.frames_per_batch // self.seq_len} chunks of a batch; pass a divisor")


SHORT = {"frames": 40_960, "log_every": 8192, "return_window": 20}
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
            kind = float if f.name == "target" else type(f.default)
            parser.add_argument(flag, type=kind, default=f.default, help=f.metadata["help"])
    if "--short" in (sys.argv[1:] if argv is None else argv):
        parser.set_defaults(**SHORT)
    args = vars(parser.parse_args(argv))
    del args["short"]
    try:
        return Config(**args)
    except ValueError as exc:
        parser.error(str(exc))


# -- the env: CartPole without its velocities ----------------------------------------------------------


class HideVelocity(gym.ObservationWrapper):
    """CartPole's observation less the two velocities: ``[cart position, pole angle]``."""

    KEEP = (0, 2)

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        box = env.observation_space
        self.observation_space = gym.spaces.Box(box.low[list(self.KEEP)], box.high[list(self.KEEP)], dtype=box.dtype)

    def observation(self, observation: np.ndarray) -> np.ndarray:
        return observation[list(self.KEEP)]


def make_env() -> gym.Env:
    """The env factory the workers call."""
    return HideVelocity(gym.make("CartPole-v1"))


# -- the model -------------------------------------------------------------------------------------


def layer_init(layer: nn.Linear, std: float = math.sqrt(2)) -> nn.Linear:
    """cleanrl's initialisation: orthogonal weights, zero biases."""
    nn.init.orthogonal_(layer.weight, std)
    nn.init.zeros_(layer.bias)
    return layer


class RecurrentAgent(nn.Module):
    """An observation encoder, a GRU cell, and two heads on its state: the actor's logits and the
    critic's value. Called by the workers one step at a time (``forward``), re-run over sequences
    by the learner (:func:`replay`)."""

    def __init__(self, obs_dim: int, n_actions: int, hidden: int, memory: bool = True) -> None:
        super().__init__()
        self.memory = memory
        self.encoder = nn.Sequential(layer_init(nn.Linear(obs_dim, hidden)), nn.Tanh())
        self.gru = nn.GRUCell(hidden, hidden)
        self.actor_head = layer_init(nn.Linear(hidden, n_actions), std=0.01)
        self.critic_head = layer_init(nn.Linear(hidden, 1), std=1.0)

    def cell(self, features: torch.Tensor, is_init: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """One GRU step ``[N, hidden] -> [N, hidden]`` from ``state``, zeroed where ``is_init``
        (``[N, 1]``) is True (and everywhere without memory)."""
        keep = (~is_init).to(state.dtype) if self.memory else torch.zeros_like(is_init, dtype=state.dtype)
        return self.gru(features, state * keep)

    def forward(self, observation: torch.Tensor, is_init: torch.Tensor,
                state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A step of all a worker's envs: the logits ``[N, actions]`` and the next state
        ``[N, 1, hidden]`` (the collector's layout: one GRU layer)."""
        next_state = self.cell(self.encoder(observation), is_init, state.squeeze(-2))
        return self.actor_head(next_state), next_state.unsqueeze(-2)


def make_actor(agent: RecurrentAgent) -> ProbabilisticTensorDictSequential:
    """What the workers run: the agent's step, then an action sampled from its logits and the
    action's log-probability (``action_log_prob``)."""
    return ProbabilisticTensorDictSequential(
        TensorDictModule(agent, in_keys=["observation", "is_init", STATE], out_keys=["logits", ("next", STATE)]),
        ProbabilisticTensorDictModule(in_keys=["logits"], out_keys=["action"],
                                      distribution_class=torch.distributions.Categorical, return_log_prob=True),
    )


# -- re-running the sequences, GAE, the loss ---------------------------------------------------------------


def replay(agent: RecurrentAgent, chunks: TensorDictBase) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Re-runs the GRU over each chunk (``[chunks, steps]``) from the state stored at the chunk's
    first step, zeroing it wherever ``is_init`` is True, as the workers did. Returns the logits
    ``[C, L, actions]``, the values ``[C, L, 1]`` and the states after each step ``[C, L, hidden]``."""
    features = agent.encoder(chunks["observation"])
    is_init = chunks["is_init"]
    state = chunks[STATE][:, 0].squeeze(-2)
    states = []
    for t in range(chunks.shape[1]):
        state = agent.cell(features[:, t], is_init[:, t], state)
        states.append(state)
    hidden = torch.stack(states, 1)
    return agent.actor_head(hidden), agent.critic_head(hidden), hidden


def to_chunks(batch: TensorDictBase, seq_len: int) -> TensorDictBase:
    """``[envs, time]`` -> ``[envs * time / seq_len, seq_len]``: each env row cut into consecutive
    chunks, in order."""
    envs, steps = batch.shape
    return batch.reshape(envs * (steps // seq_len), seq_len)


@torch.no_grad()
def advantages(agent: RecurrentAgent, cfg: Config, batch: TensorDictBase) -> float:
    """Writes ``advantage`` and ``value_target`` (``[envs, time, 1]``) into the batch, from values
    replayed chunk by chunk; returns the largest difference between the replayed log-probabilities
    of the actions and those the workers stored (float rounding when the replay is right).

    The value of ``("next", "observation")`` continues the chunk's state by one step (the true
    final observation at an episode end belongs to that episode). The one-step error bootstraps
    from it unless the episode *terminated*; the trace is cut at every episode end, and the row's
    last frame, whose episode goes on in the next batch, bootstraps with a trace of 0."""
    chunks = to_chunks(batch, cfg.seq_len)
    logits, value, hidden = replay(agent, chunks)
    replay_error = (torch.distributions.Categorical(logits=logits).log_prob(chunks["action"])
                    - chunks["action_log_prob"]).abs().max()
    hidden = hidden.reshape(-1, hidden.shape[-1])
    same_episode = torch.zeros(hidden.shape[0], 1, dtype=torch.bool)
    next_state = agent.cell(agent.encoder(chunks["next", "observation"].reshape(hidden.shape[0], -1)), same_episode,
                            hidden)
    value, next_value = value.reshape(*batch.shape, 1), agent.critic_head(next_state).reshape(*batch.shape, 1)
    not_terminated = (~batch["next", "terminated"]).float()
    not_done = (~batch["next", "done"]).float()
    delta = cfg.reward_scale * batch["next", "reward"] + cfg.gamma * not_terminated * next_value - value
    advantage = torch.zeros_like(delta)
    running = torch.zeros_like(delta[:, 0])
    for t in reversed(range(batch.shape[1])):
        running = delta[:, t] + cfg.gamma * cfg.gae_lambda * not_done[:, t] * running
        advantage[:, t] = running
    batch["advantage"] = advantage
    batch["value_target"] = advantage + value
    return float(replay_error)


def ppo_loss(agent: RecurrentAgent, cfg: Config, mb: TensorDictBase) -> TensorDict:
    """The clipped PPO loss on a minibatch of chunks, with the terms of TorchRL's
    ``ClipPPOLoss`` (each already weighted: the total loss is the sum of the ``loss_`` ones)."""
    logits, value, _ = replay(agent, mb)
    dist = torch.distributions.Categorical(logits=logits)
    log_ratio = dist.log_prob(mb["action"]) - mb["action_log_prob"]
    ratio = log_ratio.exp()
    advantage = mb["advantage"].squeeze(-1)
    advantage = (advantage - advantage.mean()) / (advantage.std() + 1e-8)
    objective = torch.min(ratio * advantage, ratio.clamp(1 - cfg.clip_coef, 1 + cfg.clip_coef) * advantage)
    return TensorDict(
        loss_objective=-objective.mean(),
        loss_critic=cfg.vf_coef * (value - mb["value_target"]).pow(2).mean(),
        loss_entropy=-cfg.ent_coef * dist.entropy().mean(),
        kl_approx=((ratio - 1) - log_ratio).mean().detach(),
    )


def ppo_update(agent: RecurrentAgent, cfg: Config, batch: TensorDictBase,
               optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """``update_epochs`` passes over the batch's chunks in shuffled minibatches; returns the last
    minibatch's loss terms."""
    chunks = to_chunks(batch, cfg.seq_len)
    size = chunks.shape[0] // cfg.num_minibatches
    for _ in range(cfg.update_epochs):
        for index in torch.randperm(chunks.shape[0]).split(size):
            terms = ppo_loss(agent, cfg, chunks[index])
            loss = sum(terms[key] for key in terms.keys() if key.startswith("loss_"))
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(agent.parameters(), cfg.max_grad_norm)
            optimizer.step()
    return {key: float(value.detach()) for key, value in terms.items()}


# -- training ----------------------------------------------------------------------------------------


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def make_collector(cfg: Config, actor: ProbabilisticTensorDictSequential) -> Collector:
    """The collector: ``prefetch=0`` (with the default ``delivery="sync"``) makes every frame of
    the next batch come from the weights published after the previous one (PPO is on-policy)."""
    return Collector(make_env, actor, frames_per_batch=cfg.frames_per_batch, total_frames=cfg.frames,
                     num_workers=cfg.num_workers, envs_per_worker=cfg.envs_per_worker,
                     recurrent_state={STATE: (1, cfg.hidden)}, exploration_type="random", prefetch=0,
                     seed=cfg.seed)


async def train(cfg: Config) -> int:
    """Runs the training; returns the exit status (1: ``cfg.target`` not reached)."""
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.torch_threads)
    env = make_env()
    agent = RecurrentAgent(env.observation_space.shape[0], int(env.action_space.n), cfg.hidden, cfg.memory)
    env.close()
    actor = make_actor(agent)
    optimizer = torch.optim.Adam(agent.parameters(), lr=cfg.learning_rate, eps=1e-5)
    num_updates = cfg.frames // cfg.frames_per_batch
    collector = make_collector(cfg, actor)
    episodes: list[tuple[int, float]] = []  # (frames collected when it was reported, return)
    collector.on(EpisodeEnded, lambda e: episodes.append((collector.frames, e.ret)))

    model = "GRU" if cfg.memory else "GRU, state zeroed every step"
    print(f"recurrent PPO on CartPole-v1 without velocities ({model}): "
          f"{cfg.num_workers} workers x {cfg.envs_per_worker} envs, {cfg.frames_per_batch} frames per batch, "
          f"sequences of {cfg.seq_len}, {num_updates} updates", flush=True)
    logged_episodes, next_log, worst_replay = 0, cfg.log_every, 0.0
    async with collector:
        collect_start = time.perf_counter()
        async for batch in collector:
            if cfg.anneal_lr:
                optimizer.param_groups[0]["lr"] = cfg.learning_rate * (1 - (collector.batches - 1) / num_updates)
            replay_error = advantages(agent, cfg, batch)
            worst_replay = max(worst_replay, replay_error)
            terms = ppo_update(agent, cfg, batch, optimizer)
            await collector.update_weights(actor)
            frames = collector.frames
            if frames >= next_log or frames >= cfg.frames:
                next_log += cfg.log_every
                new = [ret for _, ret in episodes[logged_episodes:]]
                logged_episodes = len(episodes)
                recent = [ret for _, ret in episodes[-cfg.return_window:]]
                print(f"frames {frames:>8}  fps {frames / (time.perf_counter() - collect_start):6.0f}  "
                      f"episodes {len(new):4d}  mean return {mean(new):6.1f}  "
                      f"(last {len(recent)}: {mean(recent):6.1f})  "
                      f"value loss {terms['loss_critic']:8.3g}  kl {terms['kl_approx']:.4f}  "
                      f"replay error {replay_error:.1e}", flush=True)
    loop_seconds = time.perf_counter() - collect_start
    final = mean([ret for _, ret in episodes[-cfg.return_window:]])
    print(f"final mean return {final:.1f} (last {min(cfg.return_window, len(episodes))} of {len(episodes)} "
          f"training episodes), {collector.frames} frames, largest replay error {worst_replay:.1e}, wall time "
          f"{time.perf_counter() - LAUNCHED:.1f} s since launch (training loop {loop_seconds:.1f} s)", flush=True)
    if cfg.target is not None and not final >= cfg.target:
        print(f"target not reached: final mean return {final:.1f} < {cfg.target}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Parses the command line, trains; returns the exit status."""
    return anyio.run(train, parse_config(argv))


if __name__ == "__main__":
    sys.exit(main())
