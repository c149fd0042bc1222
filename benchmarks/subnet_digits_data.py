"""The digits benchmark's data and network: ``load_digits`` split 60/20/20 and the reference's
random MLP (``benchmarks.subnet_digits``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

SPLIT_SEED = 0


def load_split(split_seed: int = SPLIT_SEED) -> dict[str, torch.Tensor]:
    """Stratified 60/20/20 split of ``load_digits``; features ÷ 16 (in [0, 1])."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    X, y = load_digits(return_X_y=True)
    X_train, X_rest, y_train, y_rest = train_test_split(
        X, y, test_size=0.4, stratify=y, random_state=split_seed
    )
    X_val, X_test, y_val, y_test = train_test_split(
        X_rest, y_rest, test_size=0.5, stratify=y_rest, random_state=split_seed
    )
    data = {}
    for part, (features, labels) in {
        "train": (X_train, y_train),
        "val": (X_val, y_val),
        "test": (X_test, y_test),
    }.items():
        data[f"X_{part}"] = torch.tensor(features / 16.0, dtype=torch.float32)
        data[f"y_{part}"] = torch.tensor(labels, dtype=torch.long)
    return data


class MLP(nn.Module):
    """64→H→H→10, ReLU; weights Kaiming-normal (fan in), biases U(±1/√fan_in) (the reference)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = (
            nn.Linear(64, hidden),
            nn.Linear(hidden, hidden),
            nn.Linear(hidden, 10),
        )
        for layer in (self.fc1, self.fc2, self.fc3):
            nn.init.kaiming_normal_(layer.weight, nonlinearity="relu", mode="fan_in")
            bound = 1 / layer.in_features**0.5
            nn.init.uniform_(layer.bias, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


def new_network(hidden: int, seed: int) -> MLP:
    torch.manual_seed(seed)
    return MLP(hidden).requires_grad_(False)


@torch.no_grad()
def accuracy(model: nn.Module, X: torch.Tensor, y: torch.Tensor) -> float:
    return float((model(X).argmax(-1) == y).float().mean())


def split_info(data: dict[str, torch.Tensor]) -> dict[str, Any]:
    return {
        "dataset": "sklearn.datasets.load_digits",
        "features": "pixel / 16",
        "fractions": [0.6, 0.2, 0.2],
        "stratified": True,
        "split_seed": SPLIT_SEED,
        "sizes": {p: len(data[f"y_{p}"]) for p in ("train", "val", "test")},
    }
