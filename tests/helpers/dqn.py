"""A deep Q-network LightningModule with a target network, after Lightning's DQN example
(``examples/pytorch/domain_templates/reinforce_learn_Qnet.py``): the same networks (an MLP from observations to one
Q-value per action, 128 hidden features, CartPole's 4 observations and 2 actions), the same loss (mean squared error
against ``reward + gamma * max_a Q_target(next_state)``, zero after the episode's end), the target network synced with
``self.target_net.load_state_dict(self.net.state_dict())`` every ``sync_rate`` steps inside ``training_step``, Adam
over the online network only. Without gym: the replay buffer is synthetic transitions of the same shapes in a map
dataset (so data parallelism splits it as it splits any dataset); the agent's environment steps, which only fill the
buffer, are left out.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

OBSERVATIONS, ACTIONS = 4, 2  # CartPole-v1


class QNetwork(nn.Module):
    def __init__(self, obs_size: int, n_actions: int, hidden_size: int = 128) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(obs_size, hidden_size), nn.ReLU(), nn.Linear(hidden_size, n_actions))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.float())


class DQNModule(L.LightningModule):
    def __init__(self, gamma: float = 0.99, sync_rate: int = 10, lr: float = 1e-2) -> None:
        super().__init__()
        self.gamma, self.sync_rate, self.lr = gamma, sync_rate, lr
        self.net = QNetwork(OBSERVATIONS, ACTIONS)
        self.target_net = QNetwork(OBSERVATIONS, ACTIONS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def dqn_mse_loss(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        states, actions, rewards, dones, next_states = batch
        state_action_values = self.net(states).gather(1, actions.unsqueeze(-1)).squeeze(-1)
        with torch.no_grad():
            next_state_values = self.target_net(next_states).max(1)[0]
            next_state_values[dones] = 0.0
        expected = next_state_values * self.gamma + rewards
        return nn.functional.mse_loss(state_action_values, expected)

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        loss = self.dqn_mse_loss(batch)
        if self.global_step % self.sync_rate == 0:
            self.target_net.load_state_dict(self.net.state_dict())
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.net.parameters(), lr=self.lr)


class ReplayDataModule(L.LightningDataModule):
    """Synthetic transitions ``(state, action, reward, done, next_state)`` of CartPole's shapes."""

    def __init__(self, batch_size: int = 16, num_samples: int = 256, seed: int = 1234) -> None:
        super().__init__()
        self.batch_size = batch_size
        g = torch.Generator().manual_seed(seed)
        states = torch.randn(num_samples, OBSERVATIONS, generator=g)
        self.data = TensorDataset(
            states,
            torch.randint(0, ACTIONS, (num_samples,), generator=g),
            torch.rand(num_samples, generator=g),
            torch.rand(num_samples, generator=g) < 0.1,
            states + 0.1 * torch.randn(num_samples, OBSERVATIONS, generator=g),
        )

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=True)
