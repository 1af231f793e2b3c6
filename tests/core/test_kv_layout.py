"""KVLayout: how layers of global and sliding-window attention group in the paged pool."""

from __future__ import annotations

import pytest

from jaxserve.core.kv_layout import KVLayout


def test_one_group_of_every_layer_without_windows_or_freeing():
    assert KVLayout.plan([None] * 4, True) == KVLayout.whole(4)
    assert KVLayout.plan([None, 16, 16], False) == KVLayout.whole(3)
    whole = KVLayout.whole(3)
    assert (whole.windows, whole.rows, whole.layer_row, whole.frees) == ((None,), 3, (0, 1, 2),
                                                                         False)


def test_every_layer_sliding_is_one_freed_group():
    layout = KVLayout.plan([24] * 5, True)
    assert (layout.windows, layout.rows, layout.layer_group, layout.frees) == (
        (24,), 5, (0,) * 5, True)


def test_gemma3_pattern_groups_of_the_global_layers_count():
    """Gemma 3 1B: 26 layers, every sixth global (4 of them): groups of 4 rows, the global
    group first, then the 22 local layers in 6 groups (the last padded by 2 rows)."""
    windows = [None if i % 6 == 5 else 512 for i in range(26)]
    layout = KVLayout.plan(windows, True)
    assert layout.rows == 4 and layout.windows == (None,) + (512,) * 6
    assert [i for i in range(26) if layout.layer_group[i] == 0] == [5, 11, 17, 23]
    # every (group, row) pair is one layer's
    pairs = list(zip(layout.layer_group, layout.layer_row, strict=True))
    assert len(set(pairs)) == 26 and all(r < layout.rows for r in layout.layer_row)
    assert sum(g == 6 for g in layout.layer_group) == 2  # the padded group


def test_local_layers_the_fewer_kind():
    """Qwen2 with max_window_layers 3 of 4: three global layers, one local."""
    layout = KVLayout.plan([None, None, None, 32], True)
    assert layout.rows == 1 and layout.windows == (None, None, None, 32)
    assert layout.layer_group == (0, 1, 2, 3)


def test_two_windows_are_refused():
    with pytest.raises(ValueError, match="one window"):
        KVLayout.plan([None, 16, 32], True)
