"""In-context linear regression (Garg, Tsipras, Liang & Valiant 2022, "What Can
Transformers Learn In-Context?", arXiv 2208.01066).

Each example draws a task ``w ~ N(0, I_d)`` and points ``x_i ~ N(0, I_d)``, labels
``y_i = wᵀ x_i`` (noise-free). The prompt interleaves them, ``x_1, y_1, ..., x_k, y_k``,
each ``y_i`` written as the vector ``(y_i, 0, ..., 0)``; the output at the position of
``x_i`` must predict ``y_i`` from the ``i - 1`` pairs before it. Inputs are real
vectors, so the model is ``attnkit.arena.models.VectorTransformer`` (a linear read-in
and read-out around TransformerLM's blocks, as the paper wraps GPT-2).

Loss: squared error divided by ``d`` (the paper's normalised error; predicting 0 scores
1, since E[y²] = d). Accuracy: the fraction of predictions with normalised squared error
below ``tolerance``, counted at points with at least ``d`` examples before them (where
least squares recovers ``w`` exactly, so a perfect learner scores 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Batch, Task, check_count, check_int


@dataclass(frozen=True)
class LinearRegression(Task):
    dim: int = 4
    seq_len: int = 32
    tolerance: float = 0.1

    name = "regression"
    paper = "arXiv:2208.01066"
    model_kind = "vectors"
    train_defaults = {"steps": 3000, "batch_size": 64, "lr": 1e-3, "target_accuracy": 0.95}

    def __post_init__(self):
        check_int(self.dim, "dim")
        check_int(self.seq_len, "seq_len", 2)
        if self.seq_len % 2:
            raise ValueError(f"seq_len: x and y alternate, so it must be even, got {self.seq_len}")
        if self.num_points <= self.dim:
            raise ValueError(
                f"seq_len: accuracy is counted after dim={self.dim} examples, so seq_len must exceed {2 * self.dim}, got {self.seq_len}"
            )
        if isinstance(self.tolerance, bool) or not isinstance(self.tolerance, (int, float)) or not self.tolerance > 0:
            raise ValueError(f"tolerance: expected > 0, got {self.tolerance!r}")

    @property
    def num_points(self) -> int:
        return self.seq_len // 2

    @property
    def input_dim(self) -> int:
        return self.dim

    @property
    def output_dim(self) -> int:
        return 1

    def sample(self, n: int, generator: torch.Generator) -> Batch:
        check_count(n)
        k, d = self.num_points, self.dim
        w = torch.randn(n, d, generator=generator)
        x = torch.randn(n, k, d, generator=generator)
        y = torch.einsum("nkd,nd->nk", x, w)
        inputs = torch.zeros(n, 2 * k, d)
        inputs[:, 0::2] = x
        inputs[:, 1::2, 0] = y
        targets = torch.zeros(n, 2 * k)
        targets[:, 0::2] = y
        mask = torch.zeros(n, 2 * k, dtype=torch.bool)
        mask[:, 0::2] = True
        return Batch(inputs, targets, mask)

    def normalised_error(self, outputs: torch.Tensor, batch: Batch) -> torch.Tensor:
        """(B, N) squared error / d (outputs: (B, N, 1))."""
        return (outputs[..., 0].float() - batch.targets) ** 2 / self.dim

    def loss(self, outputs: torch.Tensor, batch: Batch) -> torch.Tensor:
        return self.normalised_error(outputs, batch)[batch.mask].mean()

    def scored(self, outputs: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        point = torch.arange(batch.mask.shape[1]) // 2  # index of the x (or y) at each position
        counted = batch.mask & (point >= self.dim)
        correct = (self.normalised_error(outputs, batch) < self.tolerance) & counted
        return correct, counted
