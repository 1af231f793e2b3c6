"""Ragged paged attention as a Triton kernel, called from JAX through `jax_triton.triton_call`.

The second GPU backend. Same contract and work split as `kernels.pallas_attention` (tiles of
`block_q` query rows that never straddle two sequences, grid (tiles, kv heads), pages read in
place through the block table, online softmax in float32), written directly in Triton so that it
does not depend on Pallas' Triton lowering. It handles prefill chunks and decodes in one call.
GPU only: Triton has no CPU interpreter that jax-triton can call.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels.metadata import AttentionMetadata, check_attention_inputs, query_tiles

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


def available() -> str | None:
    """None if the kernel can run here, else the reason it cannot."""
    if IMPORT_ERROR is not None:
        return f"jax-triton/triton are not installed ({IMPORT_ERROR}); pip install '.[gpu]'"
    if jax.default_backend() != "gpu":
        return f"Triton kernels need a GPU; the JAX platform here is {jax.default_backend()!r}"
    return None


if triton is not None:

    @triton.jit
    def _kernel(
        q_ptr,  # (T + BQ, N, H)
        k_ptr,  # (L, P, B, KH, H)
        v_ptr,  # (L, P, B, KH, H)
        bt_ptr,  # (S, MB) int32
        layer_ptr,  # (1,) int32
        qsl_ptr,  # (S + 1,) int32
        ctx_ptr,  # (S,) int32
        tile_seq_ptr,  # (NT,) int32
        tile_row_ptr,  # (NT,) int32
        o_ptr,  # (T + BQ, N, H)
        scale: tl.constexpr,
        MB: tl.constexpr,
        P: tl.constexpr,
        N: tl.constexpr,
        KH: tl.constexpr,
        H: tl.constexpr,
        B: tl.constexpr,
        BQ: tl.constexpr,
        G: tl.constexpr,
    ):
        tile = tl.program_id(0)
        kh = tl.program_id(1)
        seq = tl.load(tile_seq_ptr + tile)
        row0 = tl.load(tile_row_ptr + tile)
        layer = tl.load(layer_ptr)
        start = tl.load(qsl_ptr + seq)
        q_len = tl.load(qsl_ptr + seq + 1) - start
        if row0 < q_len:
            ctx = tl.load(ctx_ptr + seq)
            offs_q = tl.arange(0, BQ)
            offs_h = tl.arange(0, H)
            offs_b = tl.arange(0, B)
            rows = row0 + offs_q
            row_ok = rows < q_len
            q_pos = ctx - q_len + rows
            last_pos = ctx - q_len + tl.minimum(row0 + BQ, q_len) - 1
            num_pages = last_pos // B + 1
            for g in tl.static_range(G):
                head = kh * G + g
                q_off = ((start + rows)[:, None] * N + head) * H + offs_h[None, :]
                q = tl.load(q_ptr + q_off, mask=row_ok[:, None], other=0.0)
                m = tl.full([BQ], float("-inf"), tl.float32)
                denom = tl.zeros([BQ], tl.float32)
                acc = tl.zeros([BQ, H], tl.float32)
                for j in range(0, num_pages):
                    blk = tl.load(bt_ptr + seq * MB + j)
                    # (B,) rows of the flattened pool; int64 since big pools pass 2**31
                    page_row = (layer.to(tl.int64) * P + blk) * B + offs_b
                    kv_off = (page_row[:, None] * KH + kh) * H + offs_h[None, :]
                    k = tl.load(k_ptr + kv_off)
                    v = tl.load(v_ptr + kv_off)
                    s = tl.dot(q, tl.trans(k)) * scale
                    key_pos = j * B + offs_b
                    s = tl.where(key_pos[None, :] <= q_pos[:, None], s, float("-inf"))
                    m_new = tl.maximum(m, tl.max(s, 1))
                    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                    p = tl.exp(s - m_safe[:, None])
                    alpha = tl.exp(m - m_safe)
                    denom = alpha * denom + tl.sum(p, 1)
                    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
                    m = m_new
                out = acc / tl.where(denom == 0.0, 1.0, denom)[:, None]
                tl.store(o_ptr + q_off, out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])


@functools.partial(jax.jit, static_argnames=("block_q", "num_warps", "num_stages", "scale"))
def ragged_paged_attention_triton(
    q: jax.Array,  # (T, N, H)
    k_pages: jax.Array,  # (L, P, B, K, H)
    v_pages: jax.Array,  # (L, P, B, K, H)
    layer: jax.Array,  # () int32
    md: AttentionMetadata,
    *,
    scale: float | None = None,
    block_q: int = 16,
    num_warps: int = 4,
    num_stages: int = 2,
) -> jax.Array:  # (T, N, H)
    """Same contract as `kernels.pallas_attention.ragged_paged_attention` (GPU only)."""
    reason = available()
    if reason:
        raise ValueError(reason)
    check_attention_inputs(q, k_pages, v_pages, md)
    t, n, h = q.shape
    _, p, b, kv_heads, _ = k_pages.shape
    s, mb = md.block_tables.shape
    scale = h**-0.5 if scale is None else scale
    num_tiles = t // block_q + s
    tile_seq, tile_row = query_tiles(md.query_start_loc, num_tiles, block_q)
    q_pad = jnp.pad(q, ((0, block_q), (0, 0), (0, 0)))
    out = jt.triton_call(
        q_pad, k_pages, v_pages, md.block_tables, jnp.asarray(layer, jnp.int32).reshape(1),
        md.query_start_loc, md.context_lens, tile_seq, tile_row,
        kernel=_kernel,
        out_shape=jax.ShapeDtypeStruct(q_pad.shape, q.dtype),
        grid=(num_tiles, kv_heads),
        num_warps=num_warps,
        num_stages=num_stages,
        scale=float(scale), MB=mb, P=p, N=n, KH=kv_heads, H=h, B=b, BQ=block_q, G=n // kv_heads,
    )
    return out[:t]
