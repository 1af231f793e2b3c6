"""Ragged paged attention as a Triton kernel, called from JAX through `jax_triton.triton_call`.

Same contract and work split as the Pallas kernel, pallas.py (the G query heads of a kv head
folded into a tile's rows, tiles that never straddle two sequences, grid (tiles, kv heads),
pages read in place through the block table once per kv head, online softmax in float32, each
tile's rows stored to its own slot), written directly in Triton so that it does not depend on
Pallas' Triton lowering, which JAX 0.11 deprecated. It handles prefill chunks and decodes in one
call. Through jax-triton it runs on a GPU only; tests run the same kernel in Triton's own
interpreter on torch CPU tensors, and compile it for sm_90.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxserve.kernels.attention.base import (
    NO_WINDOW,
    AttentionBackend,
    Backend,
    platform_of,
    pool_of_model_dtype,
)
from jaxserve.kernels.attention.metadata import (
    AttentionMetadata,
    check_attention_inputs,
    fold_queries,
    folded_tiles,
    page_dtypes,
    tile_rows,
    unfold_tiles,
)

try:  # Triton alone compiles the kernel (tests do, for sm_90, on machines without a GPU)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the machine
    triton = tl = None
try:  # calling it from JAX also needs jax-triton (the `gpu` extra)
    import jax_triton as jt
except ImportError as e:  # pragma: no cover - depends on the machine
    jt = None
    IMPORT_ERROR: ImportError | None = e
else:
    IMPORT_ERROR = None if triton is not None else ImportError("No module named 'triton'")


if triton is not None:

    @triton.jit
    def _kernel(
        q_ptr,  # (KH, QR, H): queries folded per kv head (row: token * G + head)
        k_ptr,  # (L, P, B, KH, H)
        v_ptr,  # (L, P, B, KH, H)
        bt_ptr,  # (S, MB) int32
        layer_ptr,  # (1,) int32
        window_ptr,  # (1,) int32: keys a row sees, its own included (NO_WINDOW: all)
        qsl_ptr,  # (S + 1,) int32
        ctx_ptr,  # (S,) int32
        tile_seq_ptr,  # (NT,) int32
        tile_row_ptr,  # (NT,) int32: tile's first token within its sequence's query rows
        o_ptr,  # (KH, NT, R, H): each tile's rows
        scale: tl.constexpr,  # the softmax's, times k_scale
        V_SCALE: tl.constexpr,  # v_scale (an fp8 pool's; else 1.0)
        MB: tl.constexpr,
        P: tl.constexpr,
        KH: tl.constexpr,
        H: tl.constexpr,
        B: tl.constexpr,
        R: tl.constexpr,  # rows of a tile: R // G tokens times G heads
        G: tl.constexpr,
        NT: tl.constexpr,
        QR: tl.constexpr,  # folded query rows per kv head (T * G + R)
    ):
        tile = tl.program_id(0)
        kh = tl.program_id(1)
        seq = tl.load(tile_seq_ptr + tile)
        row0 = tl.load(tile_row_ptr + tile)
        layer = tl.load(layer_ptr)
        window = tl.load(window_ptr)
        start = tl.load(qsl_ptr + seq)
        q_len = tl.load(qsl_ptr + seq + 1) - start
        if row0 < q_len:
            first_pos = tl.load(ctx_ptr + seq) - q_len + row0  # the tile's first token's
            last_pos = first_pos + tl.minimum(R // G, q_len - row0) - 1
            num_pages = last_pos // B + 1
            first_page = tl.maximum(first_pos - window + 1, 0) // B  # the window's oldest
            offs_r = tl.arange(0, R)
            offs_h = tl.arange(0, H)
            offs_b = tl.arange(0, B)
            # each row's token position; rows past the tile's tokens are never read back
            row_pos = first_pos + offs_r // G
            q_row = kh.to(tl.int64) * QR + (start + row0) * G + offs_r
            q = tl.load(q_ptr + q_row[:, None] * H + offs_h[None, :])  # (R, H)
            m = tl.full([R], float("-inf"), tl.float32)
            denom = tl.zeros([R], tl.float32)
            acc = tl.zeros([R, H], tl.float32)
            for j in range(first_page, num_pages):
                blk = tl.load(bt_ptr + seq * MB + j)
                # (B,) rows of the flattened pool; int64 since big pools pass 2**31
                page_row = (layer.to(tl.int64) * P + blk) * B + offs_b
                kv_off = (page_row[:, None] * KH + kh) * H + offs_h[None, :]
                # read once for the G heads; an fp8 page is widened in registers
                k = tl.load(k_ptr + kv_off).to(q.dtype)
                v = tl.load(v_ptr + kv_off).to(q.dtype)
                s = tl.dot(q, tl.trans(k)) * scale
                key_pos = j * B + offs_b
                seen = (key_pos[None, :] <= row_pos[:, None]) & (
                    key_pos[None, :] > row_pos[:, None] - window)
                s = tl.where(seen, s, float("-inf"))
                m_new = tl.maximum(m, tl.max(s, 1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                p = tl.exp(s - m_safe[:, None])
                alpha = tl.exp(m - m_safe)
                denom = alpha * denom + tl.sum(p, 1)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
                m = m_new
            out = acc * (V_SCALE / tl.where(denom == 0.0, 1.0, denom))[:, None]
            o_row = (kh.to(tl.int64) * NT + tile) * R + offs_r
            tl.store(o_ptr + o_row[:, None] * H + offs_h[None, :],
                     out.to(o_ptr.dtype.element_ty))


class Launch(NamedTuple):
    """One launch of `_kernel`: its array arguments (before the output), constexprs, grid and
    output shape, and how its per-tile output maps back to (T, N, H)."""

    args: tuple
    consts: dict
    grid: tuple[int, int]
    out_shape: tuple[int, ...]
    unfold: Callable[[jax.Array], jax.Array]


def plan_launch(q, k_pages, layer, md: AttentionMetadata, *, scale: float | None = None,
                window: jax.Array | int | None = None, block_q: int = 16,
                k_scale: float = 1.0, v_scale: float = 1.0) -> Launch:
    t, n, h = q.shape
    _, p, b, kv_heads, _ = k_pages.shape
    groups = n // kv_heads
    scale = (h**-0.5 if scale is None else scale) * k_scale
    rows = tile_rows(groups, block_q)
    tokens = rows // groups
    num_tiles, tile_seq, tile_row = folded_tiles(md, t, tokens)
    q_fold = fold_queries(q, kv_heads, rows)
    return Launch(
        args=(q_fold, md.block_tables, jnp.asarray(layer, jnp.int32).reshape(1),
              jnp.asarray(NO_WINDOW if window is None else window, jnp.int32).reshape(1),
              md.query_start_loc, md.context_lens, tile_seq, tile_row),
        consts=dict(scale=float(scale), V_SCALE=float(v_scale), MB=md.block_tables.shape[1],
                    P=p, KH=kv_heads, H=h, B=b, R=rows, G=groups, NT=num_tiles,
                    QR=q_fold.shape[1]),
        grid=(num_tiles, kv_heads),
        out_shape=(kv_heads, num_tiles, rows, h),
        unfold=functools.partial(unfold_tiles, md=md, tokens=tokens, groups=groups))


@functools.partial(jax.jit, static_argnames=("block_q", "num_warps", "num_stages", "scale",
                                             "k_scale", "v_scale"))
def ragged_paged_attention_triton(
    q: jax.Array,  # (T, N, H)
    k_pages: jax.Array,  # (L, P, B, K, H)
    v_pages: jax.Array,  # (L, P, B, K, H)
    layer: jax.Array,  # () int32
    md: AttentionMetadata,
    *,
    scale: float | None = None,
    window: jax.Array | int | None = None,
    block_q: int = 16,
    num_warps: int = 4,
    num_stages: int = 2,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> jax.Array:  # (T, N, H)
    """Same contract as the Pallas kernel's `ragged_paged_attention` (GPU only)."""
    reason = BACKEND.unavailable()
    if reason:
        raise ValueError(reason)
    check_attention_inputs(q, k_pages, v_pages, md, page_dtypes(q.dtype))
    plan = plan_launch(q, k_pages, layer, md, scale=scale, window=window, block_q=block_q,
                       k_scale=k_scale, v_scale=v_scale)
    q_fold, *ints = plan.args
    out = jt.triton_call(
        q_fold, k_pages, v_pages, *ints,
        kernel=_kernel,
        out_shape=jax.ShapeDtypeStruct(plan.out_shape, q.dtype),
        grid=plan.grid,
        num_warps=num_warps,
        num_stages=num_stages,
        **plan.consts,
    )
    return plan.unfold(out)


class TritonBackend(Backend):
    name = AttentionBackend.TRITON

    def unavailable(self, *, dtype=None, kv_dtype=None, device=None, **_):
        platform = platform_of(device)
        if IMPORT_ERROR is not None:
            missing = f"jax-triton/triton are not installed ({IMPORT_ERROR}); pip install '.[gpu]'"
        elif platform != "gpu":
            missing = f"Triton kernels need a GPU; the JAX platform here is {platform!r}"
        else:
            missing = None
        return pool_of_model_dtype(dtype, kv_dtype, fp8=True) or missing

    def fn(self):
        return ragged_paged_attention_triton


BACKEND = TritonBackend()
