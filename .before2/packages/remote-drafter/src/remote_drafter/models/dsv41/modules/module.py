"""The base of the drafter's modules, and where their weights come from."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from .numerics import Numerics

Linear = Callable[[torch.Tensor], torch.Tensor]  # x -> x @ W.T, whichever back end holds W


class Dense:
    """A dense linear: x @ W.T."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T


class DenseGroups:
    """A dense grouped linear (wo_a): [..., groups, in] -> [..., groups, out], group g through
    its own [out, in] slice of W [groups * out, in]."""

    def __init__(self, weight: torch.Tensor, groups: int):
        self.weight = weight
        self.sliced = weight.view(groups, weight.shape[0] // groups, -1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("...gi,goi->...go", x, self.sliced)


class Weights:
    """The model's weights by checkpoint name: dense tensors (already on the device, in their
    dtype) and linears another back end serves ({name: callable}: EXL3, exl3.py)."""

    def __init__(self, tensors: dict[str, torch.Tensor], served: dict[str, Linear]):
        self.tensors, self.served = tensors, served

    def tensor(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def linear(self, name: str) -> Linear:
        served = self.served.get(name)
        return served if served is not None else Dense(self.tensors[name])

    def groups(self, name: str, groups: int) -> Linear:
        """A grouped linear: the served one maps [..., groups, in] -> [..., groups, out] too."""
        served = self.served.get(name)
        return served if served is not None else DenseGroups(self.tensors[name], groups)


class Module:
    """A part of the drafter: the dense tensors it owns by checkpoint name (`own`), the
    modules it is made of (its attributes), and the shared numerics."""

    def __init__(self, numerics: Numerics):
        self.numerics = numerics
        self.own: dict[str, torch.Tensor] = {}

    def take(self, weights: Weights, name: str) -> torch.Tensor:
        self.own[name] = t = weights.tensor(name)
        return t

    def linear(self, weights: Weights, name: str) -> Linear:
        return self._owned(name, weights.linear(name))

    def groups(self, weights: Weights, name: str, groups: int) -> Linear:
        return self._owned(name, weights.groups(name, groups))

    def _owned(self, name: str, linear: Linear) -> Linear:
        if isinstance(linear, (Dense, DenseGroups)):
            self.own[name] = linear.weight
        return linear

    def parts(self) -> Iterator[Module]:
        for value in vars(self).values():
            for v in (value if isinstance(value, (list, tuple)) else [value]):
                if isinstance(v, Module):
                    yield v

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every dense tensor of this module and those under it, by name."""
        yield from self.own.items()
        for part in self.parts():
            yield from part.named_tensors()
