"""The LightningModules of the Lightning repository's ``examples/pytorch`` that ``lightning.pytorch.demos`` does not
ship, written out as published (their layers, hyperparameters and step logic; the files themselves are not copied),
and synthetic data of their datasets' shapes.

Replaced, and nothing else: torchvision's ResNet-50 (not installable here) by ``SmallResNet``, a small CNN with
ResNet's children and its 2048 output features; Gym's CartPole by ``SyntheticCartPole``, a seeded environment with
CartPole's observation (4 floats) and action (2 discrete) spaces and the old Gym step API the examples use; the
datasets (MNIST, WikiText-2, cats and dogs) by random tensors of their shapes. The GAN example is the one written out
in ``tests/test_manual_optimization.py``.
"""

from __future__ import annotations

import random
from collections import OrderedDict, deque, namedtuple
from collections.abc import Callable, Iterator
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks.finetuning import BaseFinetuning
from lightning.pytorch.utilities import rank_zero_info
from torch import nn, optim
from torch.distributions import Categorical, Normal
from torch.optim.lr_scheduler import MultiStepLR
from torch.optim.optimizer import Optimizer
from torch.utils.data import DataLoader, IterableDataset, TensorDataset
from torchmetrics import Accuracy
from typing_extensions import override


# ---------------------------------------------------------------------------------------------- synthetic data
class Tensors(L.LightningDataModule):
    """Fixed tensors for every stage (the same in every process): ``make(n, generator)`` builds a split."""

    def __init__(self, make: Callable[[int, torch.Generator], tuple], batch_size: int, samples: int = 32) -> None:
        super().__init__()
        self.batch_size = batch_size
        g = torch.Generator().manual_seed(11)
        self.splits = {stage: TensorDataset(*make(samples, g)) for stage in ("fit", "val", "test", "predict")}
        self.shuffle = True

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.splits["fit"], batch_size=self.batch_size, shuffle=self.shuffle)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.splits["val"], batch_size=self.batch_size)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.splits["test"], batch_size=self.batch_size)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(self.splits["predict"], batch_size=self.batch_size)


def mnist(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """MNIST's shapes: ``1 x 28 x 28`` images in [0, 1] (``ToTensor``) and digit labels."""
    return torch.rand(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)


def wikitext2(n: int, g: torch.Generator, vocab_size: int = 33278, block_size: int = 35) -> tuple[torch.Tensor, ...]:
    """``WikiText2``'s items: ``block_size`` token ids and the same shifted by one, over its 33278 words."""
    stream = torch.randint(0, vocab_size, (n, block_size + 1), generator=g)
    return stream[:, :-1], stream[:, 1:]


def cats_and_dogs(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The fine-tuning example's images after its transforms: ``3 x 224 x 224`` normalized, binary labels."""
    return torch.randn(n, 3, 224, 224, generator=g), torch.randint(0, 2, (n,), generator=g)


# ----------------------------------------------------------------------- basics/autoencoder.py: LitAutoEncoder
class LitAutoEncoder(L.LightningModule):
    def __init__(self, hidden_dim: int = 64, learning_rate: float = 10e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.encoder = nn.Sequential(nn.Linear(28 * 28, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, 3))
        self.decoder = nn.Sequential(nn.Linear(3, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, 28 * 28))

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.encoder(x)
        return self.decoder(z)

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._common_step(batch, batch_idx, "train")

    @override
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._common_step(batch, batch_idx, "val")

    @override
    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._common_step(batch, batch_idx, "test")

    @override
    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int | None = None) -> torch.Tensor:
        x = self._prepare_batch(batch)
        return self(x)

    @override
    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.learning_rate)

    def _prepare_batch(self, batch: Any) -> torch.Tensor:
        x, _ = batch
        return x.view(x.size(0), -1)

    def _common_step(self, batch: Any, batch_idx: int, stage: str) -> torch.Tensor:
        x = self._prepare_batch(batch)
        loss = F.mse_loss(x, self(x))
        self.log(f"{stage}_loss", loss, on_step=True)
        return loss


# --------------------------------------------------------- basics/backbone_image_classifier.py: LitClassifier
class Backbone(torch.nn.Module):
    def __init__(self, hidden_dim: int = 128) -> None:
        super().__init__()
        self.l1 = torch.nn.Linear(28 * 28, hidden_dim)
        self.l2 = torch.nn.Linear(hidden_dim, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.view(x.size(0), -1)
        x = torch.relu(self.l1(x))
        return torch.relu(self.l2(x))


class LitClassifier(L.LightningModule):
    def __init__(self, backbone: Backbone | None = None, learning_rate: float = 0.0001) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["backbone"])
        if backbone is None:
            backbone = Backbone()
        self.backbone = backbone

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone(x)

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        y_hat = self(x)
        loss = F.cross_entropy(y_hat, y)
        self.log("train_loss", loss, on_epoch=True)
        return loss

    @override
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        y_hat = self(x)
        loss = F.cross_entropy(y_hat, y)
        self.log("valid_loss", loss, on_step=True)

    @override
    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        y_hat = self(x)
        loss = F.cross_entropy(y_hat, y)
        self.log("test_loss", loss)

    @override
    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int | None = None) -> torch.Tensor:
        x, _ = batch
        return self(x)

    @override
    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.learning_rate)


# ------------------------------------------------------------------------------------ Gym's CartPole, synthetic
class _Discrete:
    def __init__(self, n: int, rng: np.random.Generator) -> None:
        self.n = n
        self._rng = rng

    def sample(self) -> int:
        return int(self._rng.integers(self.n))


class _Box:
    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape


class SyntheticCartPole:
    """CartPole's spaces and the old Gym API (``reset() -> obs``, ``step(a) -> (obs, reward, done, info)``): a
    seeded linear system pushed left or right, done when it leaves [-2.4, 2.4] or after ``max_steps``."""

    def __init__(self, seed: int = 0, max_steps: int = 30) -> None:
        self._rng = np.random.default_rng(seed)
        self.observation_space = _Box((4,))
        self.action_space = _Discrete(2, np.random.default_rng(seed + 1))
        self.max_steps = max_steps
        self._state = np.zeros(4, dtype=np.float32)
        self._steps = 0

    def reset(self) -> np.ndarray:
        self._state = self._rng.uniform(-0.05, 0.05, 4).astype(np.float32)
        self._steps = 0
        return self._state.copy()

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, dict]:
        push = 0.1 if int(np.asarray(action).reshape(-1)[0]) == 1 else -0.1
        x, v, theta, omega = (float(s) for s in self._state)
        v, omega = v + push + 0.01 * self._rng.standard_normal(), omega - 0.5 * push + 0.2 * theta
        self._state = np.array([x + 0.1 * v, v, theta + 0.1 * omega, omega], dtype=np.float32)
        self._steps += 1
        done = bool(abs(self._state[0]) > 2.4 or abs(self._state[2]) > 0.21 or self._steps >= self.max_steps)
        return self._state.copy(), 1.0, done, {}


def make_env(name: str) -> SyntheticCartPole:
    """``gym.make(name)`` for the examples' CartPole ids."""
    assert name.startswith("CartPole"), name
    return SyntheticCartPole()


# ---------------------------------------------------------- domain_templates/reinforce_learn_Qnet.py: DQN
class DQN(nn.Module):
    def __init__(self, obs_size: int, n_actions: int, hidden_size: int = 128) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(obs_size, hidden_size), nn.ReLU(), nn.Linear(hidden_size, n_actions))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.float())


Experience = namedtuple("Experience", field_names=["state", "action", "reward", "done", "new_state"])


class ReplayBuffer:
    def __init__(self, capacity: int) -> None:
        self.buffer: deque = deque(maxlen=capacity)

    def __len__(self) -> int:
        return len(self.buffer)

    def append(self, experience: Experience) -> None:
        self.buffer.append(experience)

    def sample(self, batch_size: int) -> tuple:
        indices = random.sample(range(len(self.buffer)), batch_size)
        states, actions, rewards, dones, next_states = zip(*(self.buffer[idx] for idx in indices))
        return (
            torch.tensor(states),
            torch.tensor(actions),
            torch.tensor(rewards, dtype=torch.float32),
            torch.tensor(dones, dtype=torch.bool),
            torch.tensor(next_states),
        )


class RLDataset(IterableDataset):
    def __init__(self, buffer: ReplayBuffer, sample_size: int = 200) -> None:
        self.buffer = buffer
        self.sample_size = sample_size

    def __iter__(self) -> Iterator:
        states, actions, rewards, dones, new_states = self.buffer.sample(self.sample_size)
        for i in range(len(dones)):
            yield states[i], actions[i], rewards[i], dones[i], new_states[i]


class Agent:
    def __init__(self, env: SyntheticCartPole, replay_buffer: ReplayBuffer) -> None:
        self.env = env
        self.replay_buffer = replay_buffer
        self.reset()
        self.state = self.env.reset()

    def reset(self) -> None:
        self.state = self.env.reset()

    def get_action(self, net: nn.Module, epsilon: float, device: str) -> int:
        if random.random() < epsilon:
            action = self.env.action_space.sample()
        else:
            state = torch.tensor([self.state])
            if device not in ["cpu"]:
                state = state.cuda(device)
            q_values = net(state)
            _, action_tensor = torch.max(q_values, dim=1)
            action = int(action_tensor.item())
        return action

    @torch.no_grad()
    def play_step(self, net: nn.Module, epsilon: float = 0.0, device: str = "cpu") -> tuple[float, bool]:
        action = self.get_action(net, epsilon, device)
        new_state, reward, done, _ = self.env.step(action)
        exp = Experience(self.state, action, reward, done, new_state)
        self.replay_buffer.append(exp)
        self.state = new_state
        if done:
            self.reset()
        return reward, done


class DQNLightning(L.LightningModule):
    def __init__(
        self,
        env: str = "CartPole-v1",
        replay_size: int = 200,
        warm_start_steps: int = 200,
        gamma: float = 0.99,
        eps_start: float = 1.0,
        eps_end: float = 0.01,
        eps_last_frame: int = 200,
        sync_rate: int = 10,
        lr: float = 1e-2,
        episode_length: int = 50,
        batch_size: int = 4,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.replay_size = replay_size
        self.warm_start_steps = warm_start_steps
        self.gamma = gamma
        self.eps_start = eps_start
        self.eps_end = eps_end
        self.eps_last_frame = eps_last_frame
        self.sync_rate = sync_rate
        self.lr = lr
        self.episode_length = episode_length
        self.batch_size = batch_size

        self.env = make_env(env)
        obs_size = self.env.observation_space.shape[0]
        n_actions = self.env.action_space.n

        self.net = DQN(obs_size, n_actions)
        self.target_net = DQN(obs_size, n_actions)

        self.buffer = ReplayBuffer(self.replay_size)
        self.agent = Agent(self.env, self.buffer)
        self.total_reward = 0.0
        self.episode_reward = 0.0
        self.populate(self.warm_start_steps)

    def populate(self, steps: int = 1000) -> None:
        for _ in range(steps):
            self.agent.play_step(self.net, epsilon=1.0)

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def dqn_mse_loss(self, batch: tuple) -> torch.Tensor:
        states, actions, rewards, dones, next_states = batch
        state_action_values = self.net(states).gather(1, actions.unsqueeze(-1)).squeeze(-1)
        with torch.no_grad():
            next_state_values = self.target_net(next_states).max(1)[0]
            next_state_values[dones] = 0.0
            next_state_values = next_state_values.detach()
        expected_state_action_values = next_state_values * self.gamma + rewards
        return nn.MSELoss()(state_action_values, expected_state_action_values)

    @override
    def training_step(self, batch: tuple, nb_batch: int) -> OrderedDict:
        device = self.get_device(batch)
        epsilon = max(self.eps_end, self.eps_start - (self.global_step + 1) / self.eps_last_frame)

        # step through environment with agent
        reward, done = self.agent.play_step(self.net, epsilon, device)
        self.episode_reward += reward

        # calculates training loss
        loss = self.dqn_mse_loss(batch)

        if done:
            self.total_reward = self.episode_reward
            self.episode_reward = 0

        # Soft update of target network
        if self.global_step % self.sync_rate == 0:
            self.target_net.load_state_dict(self.net.state_dict())

        log = {
            "total_reward": torch.tensor(self.total_reward).to(device),
            "reward": torch.tensor(reward).to(device),
            "steps": torch.tensor(self.global_step).to(device),
        }
        return OrderedDict({"loss": loss, "log": log, "progress_bar": log})

    @override
    def configure_optimizers(self) -> list[Optimizer]:
        optimizer = optim.Adam(self.net.parameters(), lr=self.lr)
        return [optimizer]

    def __dataloader(self) -> DataLoader:
        dataset = RLDataset(self.buffer, self.episode_length)
        return DataLoader(dataset=dataset, batch_size=self.batch_size, sampler=None)

    @override
    def train_dataloader(self) -> DataLoader:
        return self.__dataloader()

    def get_device(self, batch: Any) -> str:
        return batch[0].device.index if self.on_gpu else "cpu"


# -------------------------------------------------------------- domain_templates/reinforce_learn_ppo.py: PPO
def create_mlp(input_shape: tuple[int], n_actions: int, hidden_size: int = 128) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(input_shape[0], hidden_size),
        nn.ReLU(),
        nn.Linear(hidden_size, hidden_size),
        nn.ReLU(),
        nn.Linear(hidden_size, n_actions),
    )


class ActorCategorical(nn.Module):
    def __init__(self, actor_net: nn.Module) -> None:
        super().__init__()
        self.actor_net = actor_net

    def forward(self, states: torch.Tensor) -> tuple[Categorical, torch.Tensor]:
        logits = self.actor_net(states)
        pi = Categorical(logits=logits)
        actions = pi.sample()
        return pi, actions

    def get_log_prob(self, pi: Categorical, actions: torch.Tensor) -> torch.Tensor:
        return pi.log_prob(actions)


class ActorContinuous(nn.Module):
    def __init__(self, actor_net: nn.Module, act_dim: int) -> None:
        super().__init__()
        self.actor_net = actor_net
        log_std = -0.5 * torch.ones(act_dim, dtype=torch.float)
        self.log_std = nn.Parameter(log_std)

    def forward(self, states: torch.Tensor) -> tuple[Normal, torch.Tensor]:
        mu = self.actor_net(states)
        std = torch.exp(self.log_std)
        pi = Normal(loc=mu, scale=std)
        actions = pi.sample()
        return pi, actions

    def get_log_prob(self, pi: Normal, actions: torch.Tensor) -> torch.Tensor:
        return pi.log_prob(actions).sum(axis=-1)


class ExperienceSourceDataset(IterableDataset):
    def __init__(self, generate_batch: Callable) -> None:
        self.generate_batch = generate_batch

    def __iter__(self) -> Iterator:
        return self.generate_batch()


class PPOLightning(L.LightningModule):
    def __init__(
        self,
        env: str = "CartPole-v0",
        gamma: float = 0.99,
        lam: float = 0.95,
        lr_actor: float = 3e-4,
        lr_critic: float = 1e-3,
        max_episode_len: float = 200,
        batch_size: int = 512,
        steps_per_epoch: int = 2048,
        nb_optim_iters: int = 4,
        clip_ratio: float = 0.2,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        self.lr_actor = lr_actor
        self.lr_critic = lr_critic
        self.steps_per_epoch = steps_per_epoch
        self.nb_optim_iters = nb_optim_iters
        self.batch_size = batch_size
        self.gamma = gamma
        self.lam = lam
        self.max_episode_len = max_episode_len
        self.clip_ratio = clip_ratio
        self.save_hyperparameters()

        self.automatic_optimization = False

        self.env = make_env(env)
        # value network
        self.critic = create_mlp(self.env.observation_space.shape, 1)
        # policy network (agent): CartPole's action space is discrete
        actor_mlp = create_mlp(self.env.observation_space.shape, self.env.action_space.n)
        self.actor = ActorCategorical(actor_mlp)

        self.batch_states: list = []
        self.batch_actions: list = []
        self.batch_adv: list = []
        self.batch_qvals: list = []
        self.batch_logp: list = []

        self.ep_rewards: list = []
        self.ep_values: list = []
        self.epoch_rewards: list = []

        self.episode_step = 0
        self.avg_ep_reward = 0.0
        self.avg_ep_len = 0.0
        self.avg_reward = 0.0

        self.state = torch.FloatTensor(self.env.reset())

    @override
    def forward(self, x: torch.Tensor) -> tuple:
        pi, action = self.actor(x)
        value = self.critic(x)
        return pi, action, value

    def discount_rewards(self, rewards: list[float], discount: float) -> list[float]:
        assert isinstance(rewards[0], float)
        cumul_reward = []
        sum_r = 0.0
        for r in reversed(rewards):
            sum_r = (sum_r * discount) + r
            cumul_reward.append(sum_r)
        return list(reversed(cumul_reward))

    def calc_advantage(self, rewards: list[float], values: list[float], last_value: float) -> list[float]:
        rews = rewards + [last_value]
        vals = values + [last_value]
        # GAE
        delta = [rews[i] + self.gamma * vals[i + 1] - vals[i] for i in range(len(rews) - 1)]
        return self.discount_rewards(delta, self.gamma * self.lam)

    def generate_trajectory_samples(self) -> Iterator:
        for step in range(self.steps_per_epoch):
            self.state = self.state.to(device=self.device)

            with torch.no_grad():
                pi, action, value = self(self.state)
                log_prob = self.actor.get_log_prob(pi, action)

            next_state, reward, done, _ = self.env.step(action.cpu().numpy())

            self.episode_step += 1

            self.batch_states.append(self.state)
            self.batch_actions.append(action)
            self.batch_logp.append(log_prob)

            self.ep_rewards.append(reward)
            self.ep_values.append(value.item())

            self.state = torch.FloatTensor(next_state)

            epoch_end = step == (self.steps_per_epoch - 1)
            terminal = len(self.ep_rewards) == self.max_episode_len

            if epoch_end or done or terminal:
                # if trajectory ends abtruptly, bootstrap value of next state
                if (terminal or epoch_end) and not done:
                    self.state = self.state.to(device=self.device)
                    with torch.no_grad():
                        _, _, value = self(self.state)
                        last_value = value.item()
                        steps_before_cutoff = self.episode_step
                else:
                    last_value = 0
                    steps_before_cutoff = 0

                # discounted cumulative reward
                self.batch_qvals += self.discount_rewards(self.ep_rewards + [last_value], self.gamma)[:-1]
                # advantage
                self.batch_adv += self.calc_advantage(self.ep_rewards, self.ep_values, last_value)
                # logs
                self.epoch_rewards.append(sum(self.ep_rewards))
                # reset params
                self.ep_rewards = []
                self.ep_values = []
                self.episode_step = 0
                self.state = torch.FloatTensor(self.env.reset())

            if epoch_end:
                train_data = zip(
                    self.batch_states, self.batch_actions, self.batch_logp, self.batch_qvals, self.batch_adv
                )

                for state, action, logp_old, qval, adv in train_data:
                    yield state, action, logp_old, qval, adv

                self.batch_states.clear()
                self.batch_actions.clear()
                self.batch_adv.clear()
                self.batch_logp.clear()
                self.batch_qvals.clear()

                # logging
                self.avg_reward = sum(self.epoch_rewards) / self.steps_per_epoch

                # if epoch ended abruptly, exlude last cut-short episode to prevent stats skewness
                epoch_rewards = self.epoch_rewards
                if not done:
                    epoch_rewards = epoch_rewards[:-1]

                total_epoch_reward = sum(epoch_rewards)
                nb_episodes = len(epoch_rewards)

                self.avg_ep_reward = total_epoch_reward / nb_episodes
                self.avg_ep_len = (self.steps_per_epoch - steps_before_cutoff) / nb_episodes

                self.epoch_rewards.clear()

    def actor_loss(self, state: Any, action: Any, logp_old: Any, qval: Any, adv: Any) -> torch.Tensor:
        pi, _ = self.actor(state)
        logp = self.actor.get_log_prob(pi, action)
        ratio = torch.exp(logp - logp_old)
        clip_adv = torch.clamp(ratio, 1 - self.clip_ratio, 1 + self.clip_ratio) * adv
        return -(torch.min(ratio * adv, clip_adv)).mean()

    def critic_loss(self, state: Any, action: Any, logp_old: Any, qval: Any, adv: Any) -> torch.Tensor:
        value = self.critic(state)
        return (qval - value).pow(2).mean()

    @override
    def training_step(self, batch: tuple) -> None:
        state, action, old_logp, qval, adv = batch

        # normalize advantages
        adv = (adv - adv.mean()) / adv.std()

        self.log("avg_ep_len", self.avg_ep_len, prog_bar=True, on_step=False, on_epoch=True)
        self.log("avg_ep_reward", self.avg_ep_reward, prog_bar=True, on_step=False, on_epoch=True)
        self.log("avg_reward", self.avg_reward, prog_bar=True, on_step=False, on_epoch=True)

        optimizer_actor, optimizer_critic = self.optimizers()

        loss_actor = self.actor_loss(state, action, old_logp, qval, adv)
        self.manual_backward(loss_actor)
        optimizer_actor.step()
        optimizer_actor.zero_grad()

        loss_critic = self.critic_loss(state, action, old_logp, qval, adv)
        self.manual_backward(loss_critic)
        optimizer_critic.step()
        optimizer_critic.zero_grad()

        self.log("loss_critic", loss_critic, on_step=False, on_epoch=True, prog_bar=False, logger=True)
        self.log("loss_actor", loss_actor, on_step=False, on_epoch=True, prog_bar=True, logger=True)

    @override
    def configure_optimizers(self) -> Any:
        optimizer_actor = torch.optim.Adam(self.actor.parameters(), lr=self.lr_actor)
        optimizer_critic = torch.optim.Adam(self.critic.parameters(), lr=self.lr_critic)
        return optimizer_actor, optimizer_critic

    @override
    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        for _ in range(self.nb_optim_iters):
            super().optimizer_step(*args, **kwargs)

    def _dataloader(self) -> DataLoader:
        dataset = ExperienceSourceDataset(self.generate_trajectory_samples)
        return DataLoader(dataset=dataset, batch_size=self.batch_size)

    @override
    def train_dataloader(self) -> DataLoader:
        return self._dataloader()


# ------------------------------------------------ domain_templates/computer_vision_fine_tuning.py, ResNet small
class _Stage(nn.Module):
    """A ResNet stage reduced to one strided convolution, its norm and a ReLU."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x)))


class SmallResNet(nn.Module):
    """ResNet's children in ResNet's order (conv1, bn1, relu, maxpool, layer1-4, avgpool, fc), small, with ResNet-50's
    2048 features out of ``avgpool``: what ``list(backbone.children())[:-1]`` gives the example."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 7, stride=4, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = _Stage(8, 8, 1)
        self.layer2 = _Stage(8, 16, 2)
        self.layer3 = _Stage(16, 32, 2)
        self.layer4 = nn.Sequential(_Stage(32, 32, 2), nn.Conv2d(32, 2048, 1))
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(2048, 1000)


class MilestonesFinetuning(BaseFinetuning):
    def __init__(self, milestones: tuple = (5, 10), train_bn: bool = False) -> None:
        super().__init__()
        self.milestones = milestones
        self.train_bn = train_bn

    @override
    def freeze_before_training(self, pl_module: L.LightningModule) -> None:
        self.freeze(modules=pl_module.feature_extractor, train_bn=self.train_bn)

    @override
    def finetune_function(self, pl_module: L.LightningModule, epoch: int, optimizer: Optimizer) -> None:
        if epoch == self.milestones[0]:
            # unfreeze 5 last layers
            self.unfreeze_and_add_param_group(
                modules=pl_module.feature_extractor[-5:], optimizer=optimizer, train_bn=self.train_bn
            )
        elif epoch == self.milestones[1]:
            # unfreeze remaining layers
            self.unfreeze_and_add_param_group(
                modules=pl_module.feature_extractor[:-5], optimizer=optimizer, train_bn=self.train_bn
            )


class TransferLearningModel(L.LightningModule):
    def __init__(
        self,
        backbone: str = "resnet50",
        train_bn: bool = False,
        milestones: tuple = (2, 4),
        batch_size: int = 32,
        lr: float = 1e-3,
        lr_scheduler_gamma: float = 1e-1,
        num_workers: int = 6,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        self.backbone = backbone
        self.train_bn = train_bn
        self.milestones = milestones
        self.batch_size = batch_size
        self.lr = lr
        self.lr_scheduler_gamma = lr_scheduler_gamma
        self.num_workers = num_workers

        self.__build_model()

        self.train_acc = Accuracy(task="binary")
        self.valid_acc = Accuracy(task="binary")
        self.save_hyperparameters()

    def __build_model(self) -> None:
        # 1. Load pre-trained network (here: the small stand-in for torchvision's, randomly initialized):
        backbone = SmallResNet()

        _layers = list(backbone.children())[:-1]
        self.feature_extractor = nn.Sequential(*_layers)

        # 2. Classifier:
        _fc_layers = [nn.Linear(2048, 256), nn.ReLU(), nn.Linear(256, 32), nn.Linear(32, 1)]
        self.fc = nn.Sequential(*_fc_layers)

        # 3. Loss:
        self.loss_func = F.binary_cross_entropy_with_logits

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # 1. Feature extraction:
        x = self.feature_extractor(x)
        x = x.squeeze(-1).squeeze(-1)

        # 2. Classifier (returns logits):
        return self.fc(x)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss_func(input=logits, target=labels)

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        # 1. Forward pass:
        x, y = batch
        y_logits = self.forward(x)
        y_scores = torch.sigmoid(y_logits)
        y_true = y.view((-1, 1)).type_as(x)

        # 2. Compute loss
        train_loss = self.loss(y_logits, y_true)

        # 3. Compute accuracy:
        self.log("train_acc", self.train_acc(y_scores, y_true.int()), prog_bar=True)

        return train_loss

    @override
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        # 1. Forward pass:
        x, y = batch
        y_logits = self.forward(x)
        y_scores = torch.sigmoid(y_logits)
        y_true = y.view((-1, 1)).type_as(x)

        # 2. Compute loss
        self.log("val_loss", self.loss(y_logits, y_true), prog_bar=True)

        # 3. Compute accuracy:
        self.log("val_acc", self.valid_acc(y_scores, y_true.int()), prog_bar=True)

    @override
    def configure_optimizers(self) -> Any:
        parameters = list(self.parameters())
        trainable_parameters = list(filter(lambda p: p.requires_grad, parameters))
        rank_zero_info(
            f"The model will start training with only {len(trainable_parameters)} "
            f"trainable parameters out of {len(parameters)}."
        )
        optimizer = optim.Adam(trainable_parameters, lr=self.lr)
        scheduler = MultiStepLR(optimizer, milestones=self.milestones, gamma=self.lr_scheduler_gamma)
        return [optimizer], [scheduler]
