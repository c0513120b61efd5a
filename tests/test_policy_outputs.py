"""A plain ``nn.Module`` policy may return several outputs: a dict of tensors names them itself
(``"action"`` required), a tuple is named by ``policy_out_keys``; every output but the action
lands in the batch under its name, with the values the module computed, in worker inference (in
worker processes and in the collector's process) and in server inference. Mistakes are refused
naming the fix. A CleanRL-style PPO agent, whose forward returns its ``get_action_and_value``
as a dict, trains unchanged on the batches' log-probs and values."""

from __future__ import annotations

import anyio
import pytest
import torch
from torch import nn

from aiocollect import Collector, ConfigError, SpecError

PLACES = [
    pytest.param({"num_workers": 1}, id="worker-process"),
    pytest.param({"num_workers": 0}, id="worker-local"),
    pytest.param({"num_workers": 1, "inference": "server"}, id="server"),
]
NAMES = ["action", "sample_log_prob", "state_value"]


class ActorCritic(nn.Module):
    """Greedy actor and a critic: returns ``(action, log_prob, value)``, or the same as a dict."""

    def __init__(self, as_dict: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.actor, self.critic = nn.Linear(4, 2), nn.Linear(4, 1)
        self.as_dict = as_dict

    def outputs(self, observation: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logp = torch.log_softmax(self.actor(observation), -1)
        action = logp.argmax(-1)
        return action, logp.gather(-1, action.unsqueeze(-1)).squeeze(-1), self.critic(observation).squeeze(-1)

    def forward(self, observation: torch.Tensor):
        action, log_prob, value = self.outputs(observation)
        if self.as_dict:
            return {"action": action, "sample_log_prob": log_prob, "state_value": value}
        return action, log_prob, value


async def collect(policy, **options) -> list:
    with anyio.fail_after(60):
        async with Collector("CartPole-v1", policy, frames_per_batch=64, total_frames=128, envs_per_worker=2,
                             **options) as c:
            return [batch.clone() async for batch in c]


def check_outputs(batches: list, policy: ActorCritic) -> None:
    """Each frame holds what the module computes for its observation, under the names given."""
    for batch in batches:
        with torch.no_grad():
            action, log_prob, value = policy.outputs(batch["observation"])
        assert torch.equal(batch["action"], action)
        assert batch["sample_log_prob"].shape == batch["state_value"].shape == batch.shape
        torch.testing.assert_close(batch["sample_log_prob"], log_prob)
        torch.testing.assert_close(batch["state_value"], value)


@pytest.mark.parametrize("place", PLACES)
async def test_a_module_returning_a_dict_writes_each_output_under_its_name(place):
    policy = ActorCritic(as_dict=True)
    check_outputs(await collect(policy, **place), policy)


@pytest.mark.parametrize("place", PLACES)
async def test_a_module_returning_a_tuple_writes_the_outputs_policy_out_keys_names(place):
    policy = ActorCritic(as_dict=False)
    check_outputs(await collect(policy, policy_out_keys=NAMES, **place), policy)


class Nested(nn.Module):
    def forward(self, observation):
        n = observation.shape[0]
        return {"action": torch.zeros(n, dtype=torch.int64), "aux": {"h": observation[:, :2] * 2}}


async def test_nested_dicts_give_nested_keys_and_policy_out_keys_takes_tuples_of_names():
    (batch, _) = await collect(Nested(), num_workers=0)
    assert torch.equal(batch["aux", "h"], batch["observation"][..., :2] * 2)
    policy = ActorCritic(as_dict=False)
    (batch, _) = await collect(policy, num_workers=0, policy_out_keys=["action", ("extra", "lp"), ("extra", "v")])
    with torch.no_grad():
        torch.testing.assert_close(batch["extra", "v"], policy.outputs(batch["observation"])[2])


@pytest.mark.parametrize("place", PLACES)
async def test_a_tuple_without_policy_out_keys_says_to_name_its_outputs(place):
    with pytest.raises(SpecError, match=r"the policy returned 3 tensors, but a plain nn.Module's output is the "
                       r"action alone .*pass policy_out_keys naming each output in order.*or return a dict"):
        await collect(ActorCritic(as_dict=False), **place)


@pytest.mark.parametrize("place", PLACES)
async def test_a_dict_without_action_says_action_is_required(place):
    class NoAction(nn.Module):
        def forward(self, observation):
            return {"act": observation[:, 0].long() * 0}

    with pytest.raises(SpecError, match=r"the policy returned a dict without 'action' \(its keys: \['act'\]\): a "
                       r"policy returning a dict must put the action under 'action'"):
        await collect(NoAction(), **place)


async def test_policy_out_keys_naming_another_count_says_so():
    with pytest.raises(SpecError, match=r"returned 3 tensors, but policy_out_keys names 2: \['action', 'lp'\]; "
                       r"return one tensor per name"):
        await collect(ActorCritic(as_dict=False), num_workers=0, policy_out_keys=["action", "lp"])


@pytest.mark.parametrize(("keys", "message"), [
    ("action", "must be a list of names, one per tensor the policy returns"),
    ([], "must be a list of names"),
    (["sample_log_prob", "state_value"], "does not name the action: one of the policy's outputs must be 'action'"),
    (["action", "v", "v"], "names 'v' twice"),
    (["action", 3], "3 is not a name"),
])
def test_policy_out_keys_are_checked_at_construction(keys, message):
    with pytest.raises(ConfigError, match=message):
        Collector("CartPole-v1", ActorCritic(as_dict=False), frames_per_batch=8, policy_out_keys=keys)


def test_policy_out_keys_are_refused_for_a_tensordict_policy():
    from tensordict.nn import TensorDictModule

    policy = TensorDictModule(ActorCritic(as_dict=False), in_keys=["observation"], out_keys=NAMES)
    with pytest.raises(ConfigError, match=r"writes its outputs into the TensorDict under keys of its own .*drop "
                       r"policy_out_keys"):
        Collector("CartPole-v1", policy, frames_per_batch=8, policy_out_keys=NAMES)


# ---- a CleanRL-style PPO agent ----------------------------------------------------------------

class Agent(nn.Module):
    """CleanRL's ppo.py agent, with a forward that returns ``get_action_and_value`` as a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.critic = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 1))
        self.actor = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 2))

    def get_value(self, x):
        return self.critic(x)

    def get_action_and_value(self, x, action=None):
        probs = torch.distributions.Categorical(logits=self.actor(x))
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action), probs.entropy(), self.critic(x)

    def forward(self, observation):
        action, logprob, _, value = self.get_action_and_value(observation)
        return {"action": action, "logprob": logprob, "value": value.squeeze(-1)}


async def test_a_cleanrl_ppo_agent_trains_on_the_batches_log_probs_and_values():
    """A few PPO iterations (the README's loop, default options): each batch holds the agent's
    log-prob and value of every frame, computed by the weights of the batch's version, so before
    the first gradient step of an iteration the probability ratio is 1 and the values are the
    critic's; the clipped loss trains the agent (its weights change, the workers get them)."""
    torch.manual_seed(1)
    agent = Agent()
    optimizer = torch.optim.Adam(agent.parameters(), lr=2.5e-4, eps=1e-5)
    iterations = 0
    with anyio.fail_after(120):
        async with Collector("CartPole-v1", agent, frames_per_batch=256, total_frames=256 * 4, num_workers=2,
                             envs_per_worker=4, seed=0) as collector:
            async for batch in collector:
                assert bool((batch["collector", "policy_version"] == iterations).all())
                obs, actions = batch["observation"], batch["action"]
                rewards, dones = batch["next", "reward"][..., 0], batch["next", "done"][..., 0].float()
                with torch.no_grad():
                    torch.testing.assert_close(batch["value"], agent.get_value(obs).squeeze(-1))
                    next_value = agent.get_value(batch["next", "observation"][:, -1]).squeeze(-1)
                advantages = torch.zeros_like(rewards)  # GAE, as CleanRL computes it
                last = torch.zeros_like(next_value)
                for t in reversed(range(rewards.shape[1])):
                    following = next_value if t == rewards.shape[1] - 1 else batch["value"][:, t + 1]
                    delta = rewards[:, t] + 0.99 * following * (1 - dones[:, t]) - batch["value"][:, t]
                    last = delta + 0.99 * 0.95 * (1 - dones[:, t]) * last
                    advantages[:, t] = last
                returns = advantages + batch["value"]
                before = [p.detach().clone() for p in agent.parameters()]
                for epoch in range(4):
                    _, newlogprob, entropy, newvalue = agent.get_action_and_value(obs, actions)
                    ratio = (newlogprob - batch["logprob"]).exp()
                    if epoch == 0:  # the batch's log-probs are those of the weights that acted
                        torch.testing.assert_close(ratio, torch.ones_like(ratio))
                    adv = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
                    pg_loss = torch.max(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)).mean()
                    v_loss = 0.5 * ((newvalue.squeeze(-1) - returns) ** 2).mean()
                    loss = pg_loss - 0.01 * entropy.mean() + 0.5 * v_loss
                    optimizer.zero_grad()
                    loss.backward()
                    nn.utils.clip_grad_norm_(agent.parameters(), 0.5)
                    optimizer.step()
                assert any(not torch.equal(b, p) for b, p in zip(before, agent.parameters()))
                await collector.update_weights(agent)
                iterations += 1
    assert iterations == 4
