"""A layer param stacked on demand: what a mapped checkpoint's loader gives for each weight the
layers share, so that the runner can build the stack on its devices a layer at a time and the
host never holds more than one layer of the model (runtime/runner.py `_place_layers`).

Read as an array (np.asarray, indexing), a LayerStack is the whole stack, built then."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np


class LayerStack:
    """One tensor per layer (`parts`: views of a mapped file) and `build`, which stacks a list
    of them into the param's layout (layers on axis 0). `release(parts)` gives the pages of
    parts already copied out back to the system."""

    def __init__(self, parts: list, build: Callable[[list], np.ndarray],
                 release: Callable[[list], None] | None = None):
        self.parts, self._build, self._release = parts, build, release
        self._meta: tuple[tuple[int, ...], np.dtype] | None = None

    def layer(self, i: int) -> np.ndarray:
        """Layer i's slice of the stack, (1, ...)."""
        return self._build(self.parts[i:i + 1])

    def release(self, i: int) -> None:
        if self._release is not None:
            self._release(self.parts[i:i + 1])

    def _shape_dtype(self) -> tuple[tuple[int, ...], np.dtype]:
        if self._meta is None:  # from layer 0 built once: the layers are alike
            first = self.layer(0)
            self._meta = (len(self.parts), *first.shape[1:]), first.dtype
        return self._meta

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape_dtype()[0]

    @property
    def dtype(self) -> np.dtype:
        return self._shape_dtype()[1]

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * self.dtype.itemsize

    def __len__(self) -> int:
        return len(self.parts)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        whole = self._build(self.parts)
        return whole if dtype is None else whole.astype(dtype)

    def __getitem__(self, index) -> np.ndarray:
        if isinstance(index, int | np.integer):
            return self.layer(int(index) % len(self))[0]
        return np.asarray(self)[index]


def holds_stacks(tree: Any) -> bool:
    return any(isinstance(a, LayerStack) for a in jax.tree.leaves(tree))


def layer_of(tree: Any, i: int) -> Any:
    """Layer i of a tree of stacked layer params (LayerStacks or arrays), each (1, ...)."""
    return jax.tree.map(lambda a: a.layer(i) if isinstance(a, LayerStack) else a[i:i + 1],
                        tree)


def release_layer(tree: Any, i: int) -> None:
    for a in jax.tree.leaves(tree):
        if isinstance(a, LayerStack):
            a.release(i)


def built(tree: Any) -> Any:
    """`tree` with every LayerStack stacked whole on the host."""
    return jax.tree.map(lambda a: np.asarray(a) if isinstance(a, LayerStack) else a, tree)
