"""Ragged paged attention as a Pallas kernel: prefill chunks and decodes of one step in one call.

Lowering: Pallas' Triton backend (`jax.experimental.pallas.triton`): a data-dependent walk over
a block table (one scalar load per page) with plain `load`/`store` and a `fori_loop`, the same
body running under `interpret=True` on a CPU, which is how it is tested in CI. JAX 0.11
deprecated this lowering; on Hopper, mosaic.py (Mosaic GPU: bulk copies through a
ring of shared-memory slots, warpgroup MMAs) comes first, and this kernel stays for the other
GPUs while the lowering exists.

Work split: the G query heads of a kv head are folded into the tile's rows (metadata.py):
a program owns one (query tile, kv head), whose `rows` rows (a power of two >= 16, Triton's
smallest dot) are `rows // G` tokens of one sequence times the G heads. It loads its tile's
queries in one block, walks the sequence's pages up to the last position its tokens can see
(causal per row), reading each K/V page in place through the block table once for all G heads,
keeps an online softmax in float32, and stores its whole tile to its own output slot; the
wrapper maps the tiles back to (T, N, H). With a sliding window the walk starts at the page
holding the first key its first token still sees.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

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
    tile_extent,
    tile_rows,
    unfold_tiles,
)
from jaxserve.kernels.attention.reference import visible

try:  # deprecated in JAX 0.11, and gone from later JAX
    from jax.experimental.pallas import triton as plgpu
except ImportError as e:  # pragma: no cover - depends on the JAX
    plgpu, IMPORT_ERROR = None, e
else:
    IMPORT_ERROR = None

# ----------------------------------------------------------------------------------- kernel body


def _kernel(
    tile_seq_ref,  # (NT,) int32: sequence of each tile
    tile_row_ref,  # (NT,) int32: tile's first token within its sequence's query rows
    qsl_ref,  # (S + 1,) int32: query_start_loc
    ctx_ref,  # (S,) int32: context length after this step
    bt_ref,  # (S, MB) int32: block tables
    layer_ref,  # (1,) int32: which layer of the pool to read
    window_ref,  # (1,) int32: keys a row sees, its own included (NO_WINDOW: all)
    q_ref,  # (K, T * G + R, H): queries folded per kv head (row: token * G + head)
    k_ref,  # (L, P, B, K, H)
    v_ref,  # (L, P, B, K, H)
    o_ref,  # (K, NT, R, H): each tile's rows
    *,
    groups: int,
    scale: float,  # the softmax's, times k_scale
    v_scale: float,
):
    tile, kh = pl.program_id(0), pl.program_id(1)
    page = k_ref.shape[2]
    rows, h = o_ref.shape[2:]
    x = tile_extent(tile, rows // groups, tile_seq_ref, tile_row_ref, qsl_ref, ctx_ref)
    seq = x.seq

    @pl.when(x.active)
    def _():
        layer, window = layer_ref[0], window_ref[0]
        num_pages = x.last_pos // page + 1
        first_page = jnp.maximum(x.first_pos - window + 1, 0) // page
        q = plgpu.load(q_ref.at[kh, pl.ds((x.start + x.row0) * groups, rows), :])  # (R, H)
        # position of each row's token; rows past the tile's tokens are never read back
        row_pos = x.first_pos + jnp.arange(rows, dtype=jnp.int32) // groups  # (R,)

        def body(j, carry):
            m, denom, acc = carry
            blk = bt_ref[seq, j]
            # an fp8 page is widened in registers; its scales are folded in (k: `scale`)
            k = plgpu.load(k_ref.at[layer, blk, :, kh, :]).astype(q.dtype)  # (B, H)
            v = plgpu.load(v_ref.at[layer, blk, :, kh, :]).astype(q.dtype)  # (B, H)
            key_pos = j * page + jnp.arange(page, dtype=jnp.int32)  # (B,)
            s = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * scale  # (R, B)
            s = jnp.where(visible(key_pos[None, :], row_pos[:, None], window), s, -jnp.inf)
            m_new = jnp.maximum(m, s.max(axis=-1))  # (R,)
            # Rows that see no key yet keep m = -inf; guard the rescale against inf - inf.
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            p = jnp.exp(s - m_safe[:, None])  # (R, B)
            alpha = jnp.exp(m - m_safe)  # (R,)
            denom = alpha * denom + p.sum(axis=-1)
            acc = alpha[:, None] * acc + jnp.dot(p.astype(v.dtype), v,
                                                 preferred_element_type=jnp.float32)
            return m_new, denom, acc

        init = (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32),
                jnp.zeros((rows, h), jnp.float32))
        _, denom, acc = jax.lax.fori_loop(first_page, num_pages, body, init)
        out = acc * (v_scale / jnp.where(denom == 0, 1.0, denom))[:, None]
        plgpu.store(o_ref.at[kh, tile], out.astype(o_ref.dtype))


# ----------------------------------------------------------------------------- pallas_call build


def _build(num_tiles: int, rows: int, h: int, kv_heads: int, groups: int, dtype, *,
           scale: float, v_scale: float, interpret: bool, num_warps: int, num_stages: int):
    kernel = functools.partial(_kernel, groups=groups, scale=scale, v_scale=v_scale)
    params = None if interpret else plgpu.CompilerParams(num_warps=num_warps,
                                                         num_stages=num_stages)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((kv_heads, num_tiles, rows, h), dtype),
        grid=(num_tiles, kv_heads),
        interpret=interpret,
        compiler_params=params,
        name="ragged_paged_attention",
    )


# ---------------------------------------------------------------------------------- public entry


@functools.partial(jax.jit, static_argnames=("block_q", "interpret", "num_warps", "num_stages",
                                             "scale", "k_scale", "v_scale"))
def ragged_paged_attention(
    q: jax.Array,  # (T, N, H)
    k_pages: jax.Array,  # (L, P, B, K, H)
    v_pages: jax.Array,  # (L, P, B, K, H)
    layer: jax.Array,  # () int32
    md: AttentionMetadata,
    *,
    scale: float | None = None,
    window: jax.Array | int | None = None,
    block_q: int = 16,
    interpret: bool = False,
    num_warps: int = 4,
    num_stages: int = 2,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> jax.Array:  # (T, N, H)
    """Attention of one step's ragged query rows over the paged KV pool.

    The pools hold every layer; `layer` picks one, so the caller never slices a copy out.
    Rows of sequence s are q[query_start_loc[s]:query_start_loc[s + 1]], at positions ending at
    context_lens[s] - 1; each attends causally to its sequence's first (position + 1) keys,
    found through block_tables[s], or to the newest `window` of them. Rows past
    query_start_loc[-1] are padding and come back unspecified. float32, bfloat16 or float16
    inputs; the pools of q's dtype, or fp8 ones holding K / k_scale and V / v_scale; float32
    accumulation. `block_q`: the fewest rows of a tile (16, Triton's smallest
    dot); G > block_q heads take a larger tile.
    """
    check_attention_inputs(q, k_pages, v_pages, md, page_dtypes(q.dtype))
    t, n, h = q.shape
    kv_heads = k_pages.shape[3]
    groups = n // kv_heads
    scale = (h**-0.5 if scale is None else scale) * k_scale
    rows = tile_rows(groups, block_q)
    tokens = rows // groups
    num_tiles, tile_seq, tile_row = folded_tiles(md, t, tokens)
    call = _build(num_tiles, rows, h, kv_heads, groups, q.dtype, scale=scale, v_scale=v_scale,
                  interpret=interpret, num_warps=num_warps, num_stages=num_stages)
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    window = jnp.asarray(NO_WINDOW if window is None else window, jnp.int32).reshape(1)
    out = call(tile_seq, tile_row, md.query_start_loc, md.context_lens, md.block_tables, layer,
               window, fold_queries(q, kv_heads, rows), k_pages, v_pages)  # (K, NT, R, H)
    return unfold_tiles(out, md, tokens, groups)


class PallasBackend(Backend):
    name = AttentionBackend.PALLAS

    def unavailable(self, *, dtype=None, kv_dtype=None, device=None, **_):
        platform = platform_of(device)
        if platform not in ("gpu", "cpu"):
            lowering = f"Pallas' Triton lowering cannot run on platform {platform!r}"
        elif IMPORT_ERROR is not None:
            lowering = f"this JAX has no Pallas Triton lowering ({IMPORT_ERROR})"
        else:
            lowering = None
        return pool_of_model_dtype(dtype, kv_dtype, fp8=True) or lowering

    def fn(self):
        # On a CPU the kernel body runs in Pallas' interpreter: correct, slow, for testing.
        return functools.partial(ragged_paged_attention,
                                 interpret=jax.default_backend() == "cpu")


BACKEND = PallasBackend()
