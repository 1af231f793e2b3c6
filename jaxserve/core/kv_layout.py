"""How the layers' K/V share the paged pool: one group of all layers, or, for a model with
sliding-window layers whose out-of-window blocks are freed, groups of layers with a block
table each.

A model whose layers all see their whole context (or all slide alike) keeps one group: a block
id names a page of every layer, and a sequence has one block table. A model that mixes global
and local (sliding-window) layers (Gemma 3, Qwen with max_window_layers) cannot free a block
that its global layers still read while its local layers no longer do, if one id names both.
So the layers are split into groups of equal size R, each of one kind (the pool is
(R, P, B, K, H): a block id names a page of R layers), and each group gets its own block table:
a sequence holds a page of every global group for each of its blocks, and a page of every local
group only for the blocks inside the window. Global and local pages come from one free queue,
so the split between them follows the load. R is the smaller of the two layer counts; the
larger kind's last group is padded with rows no layer uses (vLLM's hybrid allocator lays out
Gemma 3 alike).

Host only: the block manager reads the groups' windows, the model and the step builder the
rest.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class KVLayout:
    windows: tuple[int | None, ...]  # per group: its layers' sliding window (None: global)
    rows: int  # layers per group: the pool's first axis
    layer_group: tuple[int, ...]  # (L,): the group of each layer
    layer_row: tuple[int, ...]  # (L,): its row in the pool

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def window(self) -> int | None:
        """The local groups' window (None where every group is global)."""
        return next((w for w in self.windows if w is not None), None)

    @property
    def frees(self) -> bool:
        """Whether a sequence's blocks before the window leave its local groups' tables."""
        return self.window is not None

    @staticmethod
    def whole(num_layers: int) -> KVLayout:
        """One group of every layer, never freed: the pool as (L, P, B, K, H)."""
        return KVLayout((None,), num_layers, (0,) * num_layers, tuple(range(num_layers)))

    @staticmethod
    def plan(layer_windows: list[int | None], free_windows: bool) -> KVLayout:
        """The layout of layers with these windows (None: global). Without `free_windows`,
        or with no window, one group that keeps every block."""
        n = len(layer_windows)
        local = [i for i, w in enumerate(layer_windows) if w is not None]
        glob = [i for i, w in enumerate(layer_windows) if w is None]
        if not free_windows or not local:
            return KVLayout.whole(n)
        if len({layer_windows[i] for i in local}) != 1:
            raise ValueError("freeing sliding-window blocks needs one window for every "
                             f"local layer, got {sorted({layer_windows[i] for i in local})}")
        window = layer_windows[local[0]]
        if not glob:  # every layer slides: one group, freed
            return KVLayout((window,), n, (0,) * n, tuple(range(n)))
        rows = min(len(glob), len(local))
        windows, group, row = [], [0] * n, [0] * n
        for layers, w in ((glob, None), (local, window)):  # global groups first: group 0
            for start in range(0, len(layers), rows):
                for r, i in enumerate(layers[start:start + rows]):
                    group[i], row[i] = len(windows), r
                windows.append(w)
        return KVLayout(tuple(windows), rows, tuple(group), tuple(row))
