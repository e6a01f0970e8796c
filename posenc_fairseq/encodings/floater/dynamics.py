"""FLOATER's dynamics network h (paper eq. 10) and its bounded forms: what the ODE db/dt = h(t, b) is."""
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class Dynamics(nn.Module):
    """h(tau, b) = W2 [relu(W1 [b; tau] + c1); tau] + c2, applied to every row of b (N, d).

    `autonomous`: h(b) = W2 [relu(W1 [b; 0] + c1); 0] + c2, the time columns of W1 and W2 held at
    zero (the parameters keep their shapes, so checkpoints load either way): a flow that is the same
    at every position (the paper's h sees tau, also past the training lengths, where it never saw it).

    `max_speed` S and `decay` L bound the flow: db/dt = exp(-L tau) S tanh(h / S), so every coordinate
    moves at most S exp(-L tau) per unit of time and |b(t) - b(0)| <= S / L for every t, coordinate by
    coordinate, whatever the weights: past the training lengths the biases settle instead of running
    away. `stop_time` T: db/dt = 0 for t > T (b(t) = b(T) from there on, as a clipped relative distance
    or the last row of a learned table). All keep h == 0 the identity. What each does past the
    training lengths, measured: docs/floater.md, "Length extrapolation: measured"."""

    def __init__(self, dim: int, hidden: int, init: str = "zero", autonomous: bool = False,
                 max_speed: Optional[float] = None, decay: float = 0.0, stop_time: Optional[float] = None):
        super().__init__()
        self.fc1 = nn.Linear(dim + 1, hidden)
        self.fc2 = nn.Linear(hidden + 1, dim)
        self.autonomous, self.max_speed, self.decay, self.stop_time = autonomous, max_speed, decay, stop_time
        self.initialise(init)

    def initialise(self, init: str):
        with torch.no_grad():
            if init == "zero":  # h == 0: the model is exactly the stock model
                self.fc2.weight.zero_()
                self.fc2.bias.zero_()
            elif init == "small":  # the paper's "smaller weights": close to, but not exactly, stock
                self.fc2.weight.normal_(0.0, 1e-3)
                self.fc2.bias.zero_()
            else:
                raise ValueError(f"unknown --floater-init {init!r} (zero|small)")

    @property
    def form(self) -> tuple:
        """What h computes besides its parameters (a solved table depends on it)."""
        return self.autonomous, self.max_speed, self.decay, self.stop_time

    def weights(self, dtype: torch.dtype) -> List[Tensor]:
        """(W1, c1, W2, c2) in `dtype` (a differentiable cast: gradients reach the parameters)."""
        w1, c1, w2, c2 = (p.to(dtype) for p in (self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias))
        if self.autonomous:  # every solver reads these weights: zero time columns, zero gradient there
            w1, w2 = without_time_column(w1), without_time_column(w2)
        return [w1, c1, w2, c2]

    @property
    def is_paper_form(self) -> bool:
        """h = W2 [relu(...); tau] + c2 exactly: the form the fast fixed-grid integrators are written for."""
        return self.max_speed is None and not self.decay and self.stop_time is None

    def function(self, weights: List[Tensor]):
        """h(t, b) with these (W1, c1, W2, c2) and this network's bounds, for torchdiffeq."""
        return dynamics_function(*weights, max_speed=self.max_speed, decay=self.decay, stop_time=self.stop_time)


def without_time_column(weight: Tensor) -> Tensor:
    """`weight` with its last (time) column replaced by zeros."""
    return torch.cat([weight[:, :-1], weight.new_zeros(weight.size(0), 1)], dim=1)


def dynamics_function(w1: Tensor, c1: Tensor, w2: Tensor, c2: Tensor, max_speed: Optional[float] = None,
                      decay: float = 0.0, stop_time: Optional[float] = None):
    """h as a function of (t, b) with the given weights, for torchdiffeq; with `max_speed` S,
    `decay` L and `stop_time` T (see `Dynamics`), exp(-L t) S tanh(h / S) up to T and 0 after."""

    def h(t: Tensor, state: Tensor) -> Tensor:
        tau = t.to(state.dtype)
        hidden = F.relu(F.linear(torch.cat([state, tau.expand(state.size(0), 1)], dim=-1), w1, c1))
        velocity = F.linear(torch.cat([hidden, tau.expand(state.size(0), 1)], dim=-1), w2, c2)
        if max_speed is not None:
            velocity = max_speed * torch.tanh(velocity / max_speed)
        if decay:
            velocity = velocity * torch.exp(-decay * tau)
        if stop_time is not None:
            velocity = velocity * (tau <= stop_time)
        return velocity

    return h
