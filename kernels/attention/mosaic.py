"""Ragged paged attention for Hopper (sm_90a) on Pallas' Mosaic GPU backend.

Why a second Pallas kernel: JAX 0.11 deprecated Pallas' Triton lowering (pallas.py),
and Mosaic GPU exposes what Hopper is built around: the bulk-copy engine (TMA) that moves a
page from HBM to shared memory without the threads, mbarriers to wait for it, and warpgroup
MMAs that read their operands from shared memory.

**GQA folded into the tile's rows.** A program owns one (query tile, kv head). Its 64 rows (one
warpgroup MMA's M) hold query tokens of one sequence times the G query heads that share the kv
head (row: token * G + head; metadata.py, shared with the Triton-lowered kernel). A decode step
of one sequence fills G rows, and each page is read once per kv head. A bulk copy into shared
memory tiled by 8 rows must start on a multiple of 8, and a tile's first folded row,
(start + row0) * G, often does not (G = 3: a decode's is 3 * its row); so each program copies
the 64 rows from the multiple of 8 at or before it, straight from the folded queries, and its
tile holds as many tokens as fit after that lead (19 for G = 3, 57 for G = 1). Its output goes
to a slot of its own, so no store is ragged.

**Page walk.** A step of the loop covers `pages_per_step` pages (`pages_per_step * B` keys, the
MMA's N for QK^T and K for PV); each page is a (B, H) box of the pool, found through the block
table and copied by the TMA into its rows of a shared-memory slot. `num_stages` slots form a
ring: the copies for step s + num_stages are issued as soon as step s has consumed its slot, so
they overlap the MMAs of the steps in between. Each step waits on its slot's K barrier, runs
S = Q K^T (f32 accumulator), masks causally per row (key position <= the row's token position),
updates the online softmax in f32 (base-2 exponentials, the scale folded into log2 e), waits on
the V barrier and accumulates P V. The walk stops at the last page the tile's last token can
see, and with a sliding window starts at the step holding the first key its first token still
sees; entries past a sequence's own pages are clamped into the table and masked out.

**The step's KV write stays a separate scatter** (kv_write.py, before this call), as for the
other backends. Fusing it (TMA stores of the step's new K/V rows into their pages, the pool
aliased in and out) would save one pass over those rows, T * K * H * 2 values per layer, which
is small next to the pages a step reads; whether it pays is a GPU measurement this kernel has
not had yet.

Lowering semantics are pinned to warpgroup (JAX 0.11's default; 0.10's was lane): its layout
inference refuses a bulk copy into tiled shared memory that it cannot prove starts on a tile
boundary, where lane semantics lower one that reads the wrong rows.

**fp8 pools** (kv_cache_dtype fp8, fp8_e5m2): the bulk copies move fp8 pages (half the bytes)
into fp8 slots; each step widens its K slot, then its V slot, in registers into one shared-memory
operand of q's dtype for the MMA. k_scale is folded into the softmax scale, v_scale into the
output's normalization.

Constraints: bfloat16 or float16 (the MMA's input types), head_dim a multiple of 64 (the 128-byte
swizzle), G <= 64, block size a multiple of 8 dividing `pages_per_step * B` <= 256.

On a CPU the kernel runs in Pallas' GPU interpreter (simulated shared memory, TMA, barriers and
MMAs): slow, for tests. It lowers for a CUDA target without a GPU (a Mosaic GPU custom call for
sm_90a), which CI checks.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxserve.kernels.attention.base import (
    NO_WINDOW,
    AttentionBackend,
    Backend,
    platform_of,
    pool_of_model_dtype,
)
from jaxserve.kernels.attention.metadata import (
    ALIGN,
    AttentionMetadata,
    aligned_tokens,
    check_attention_inputs,
    fold_queries,
    folded_tiles,
    page_dtypes,
    tile_extent,
    tile_offsets,
    unfold_tiles,
)

try:  # not in every JAX
    from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError as e:  # pragma: no cover - depends on the JAX
    plgpu, IMPORT_ERROR = None, e
else:
    IMPORT_ERROR = None

TILE_ROWS = 64  # a warpgroup MMA's M: the query rows (token x head) of one program
_LOG2E = math.log2(math.e)


def supports(dtype, head_dim: int, groups: int, block_size: int,
             pages_per_step: int = 4) -> str | None:
    """Why this kernel cannot take these shapes, or None when it can."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"dtype must be bfloat16 or float16, got {jnp.dtype(dtype).name}"
    if head_dim % 64:
        return f"head_dim must be a multiple of 64, got {head_dim}"
    if groups > TILE_ROWS:
        return f"query heads per kv head must be <= {TILE_ROWS}, got {groups}"
    if block_size % 8 or block_size * pages_per_step > 256:
        return (f"block_size must be a multiple of 8 with block_size * pages_per_step <= 256, "
                f"got {block_size} x {pages_per_step}")
    return None


# ----------------------------------------------------------------------------------- kernel body


def _kernel(
    tile_seq_ref,  # (NT,) int32: sequence of each tile
    tile_row_ref,  # (NT,) int32: tile's first token within its sequence's query rows
    qsl_ref,  # (S + 1,) int32: query_start_loc
    ctx_ref,  # (S,) int32: context length after this step
    bt_ref,  # (S, MB) int32: block tables
    layer_ref,  # (1,) int32: which layer of the pool to read
    window_ref,  # (1,) int32: keys a row sees, its own included (NO_WINDOW: all)
    q_ref,  # (K, R, H): the queries, folded (row: token * G + head), R >= T * G + 64
    k_ref,  # (L, P, B, K, H)
    v_ref,  # (L, P, B, K, H)
    o_ref,  # (K, NT, 64, H): each tile's rows
    q_smem,  # (64, H): the tile's queries, then its output
    k_smem,  # (num_stages, pages_per_step * B, H)
    v_smem,  # (num_stages, pages_per_step * B, H)
    q_bar,
    k_bar,  # num_stages barriers, pages_per_step copies each
    v_bar,
    *wide,  # an fp8 pool's: (pages_per_step * B, H) each for K and V, in q's dtype
    groups: int,
    pages_per_step: int,
    num_stages: int,
    scale: float,  # the softmax's, times k_scale
    v_scale: float,
    interpret: bool,
):
    # Register layouts are the GPU lowering's business; Pallas' GPU interpreter (a CPU) has
    # no rules for them, and the values are the same without.
    if interpret:
        layout_cast = lambda x, layout: x  # noqa: E731
        iota = lambda dtype, shape, dim, layout: lax.broadcasted_iota(dtype, shape, dim)  # noqa: E731
    else:
        layout_cast = plgpu.layout_cast
        iota = plgpu.broadcasted_iota
    def mma(a, b_ref, shape, transpose_b=False):
        """a @ b (b transposed if asked) into a fresh f32 (shape) accumulator: a warpgroup
        MMA on the GPU. The interpreter's MMA takes neither an A held in registers nor a
        transposed B, so there the product of the same operands is a plain dot."""
        if interpret:
            a = a[...] if hasattr(a, "at") else a
            b = b_ref[...]
            return jnp.dot(a, b.T if transpose_b else b, preferred_element_type=jnp.float32)
        b_ref = b_ref.transpose((1, 0)) if transpose_b else b_ref

        def scope(acc_ref):
            plgpu.wgmma(acc_ref, a, b_ref)
            return acc_ref[...]

        return pl.run_scoped(scope, plgpu.ACC(shape, jnp.float32))

    tile, kh = lax.axis_index("tile"), lax.axis_index("kv")
    page, width = k_ref.shape[2], bt_ref.shape[1]
    rows, head_dim = q_smem.shape
    keys = page * pages_per_step  # keys per step of the walk
    tokens = aligned_tokens(groups, rows)
    x = tile_extent(tile, tokens, tile_seq_ref, tile_row_ref, qsl_ref, ctx_ref)
    seq = x.seq
    # the tile's rows are read from the aligned row at or before its first, `lead` rows in
    first = (x.start + x.row0) * groups
    aligned = lax.div(first, jnp.int32(ALIGN)) * ALIGN
    lead = first - aligned

    @pl.when(x.active)
    def _():
        layer, window = layer_ref[0], window_ref[0]
        # steps [first_step, last_step) of the walk hold keys the tile sees; the ring's slots
        # count from the first
        first_step = lax.div(jnp.maximum(x.first_pos - window + 1, 0), jnp.int32(keys))
        num_steps = lax.div(x.last_pos, jnp.int32(keys)) + 1 - first_step

        def fetch(step, slot):
            for p in range(pages_per_step):
                at = (first_step + step) * pages_per_step + p
                blk = bt_ref[seq, jnp.minimum(at, width - 1)]
                rows_p = pl.ds(p * page, page)
                plgpu.copy_gmem_to_smem(k_ref.at[layer, blk, :, kh, :], k_smem.at[slot, rows_p],
                                        k_bar.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[layer, blk, :, kh, :], v_smem.at[slot, rows_p],
                                        v_bar.at[slot])

        plgpu.copy_gmem_to_smem(q_ref.at[kh, pl.ds(pl.multiple_of(aligned, ALIGN), rows)],
                                q_smem, q_bar)
        for i in range(num_stages):  # fill the ring
            pl.when(i < num_steps)(functools.partial(fetch, i, i))
        plgpu.barrier_wait(q_bar)

        layout = plgpu.Layout.WGMMA
        row_ids = iota(jnp.int32, (rows, keys), 0, layout=layout)
        key_ids = iota(jnp.int32, (rows, keys), 1, layout=layout)
        # position of each row's token (row r is token (r - lead) // G); keys past it are
        # masked. The rows before `lead` and past the tile's tokens are others', never read.
        # Divided as non-negative: `back` tokens earlier, every row's token index is >= 0.
        back = -(-ALIGN // groups)
        row_pos = (x.first_pos - back) + (row_ids + (back * groups - lead)) // groups
        row_of = lambda x: lax.broadcast_in_dim(x, (rows, keys), [0])  # noqa: E731

        def operand(ring, slot, i):
            """The MMA's B operand of a slot: the slot itself, or an fp8 slot widened in
            registers into wide[i] (the previous step's MMAs, which read it, are done)."""
            if not wide:
                return ring.at[slot]
            # through float16 (exact for both fp8 formats): Hopper converts fp8 to f16 alone
            wide[i][...] = ring[slot].astype(jnp.float16).astype(wide[i].dtype)
            plgpu.commit_smem()  # the threads' stores, seen by the MMA
            return wide[i]

        def step_fn(step, carry):
            acc, m, denom = carry
            slot = lax.rem(step, jnp.int32(num_stages))
            plgpu.barrier_wait(k_bar.at[slot])

            s = mma(q_smem, operand(k_smem, slot, 0), (rows, keys), transpose_b=True)
            key_pos = key_ids + (first_step + step) * keys
            seen = (key_pos <= row_pos) & (key_pos > row_pos - window)
            s = jnp.where(seen, s * (scale * _LOG2E), -jnp.inf)
            m_new = jnp.maximum(m, s.max(axis=1))
            # rows that see no key yet keep m = -inf: rescale against 0 instead of -inf - -inf
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            p = jnp.exp2(s - row_of(m_safe))
            alpha = jnp.exp2(m - m_safe)
            denom = denom * alpha + p.sum(axis=1)
            plgpu.barrier_wait(v_bar.at[slot])

            # a fresh accumulator, added: (64, H) adds, against initializing one from `acc`
            acc = (acc * lax.broadcast_in_dim(alpha, (rows, head_dim), [0])
                   + mma(p.astype(q_smem.dtype), operand(v_smem, slot, 1), (rows, head_dim)))
            # the slot's MMAs are done (their results were read): refill it for a later step
            pl.when(step + num_stages < num_steps)(
                functools.partial(fetch, step + num_stages, slot))
            return acc, m_new, denom

        init = (layout_cast(jnp.zeros((rows, head_dim), jnp.float32), layout),
                layout_cast(jnp.full((rows,), -jnp.inf, jnp.float32), layout.reduce(1)),
                layout_cast(jnp.zeros((rows,), jnp.float32), layout.reduce(1)))
        acc, _, denom = lax.fori_loop(0, num_steps, step_fn, init)
        denom = jnp.where(denom == 0.0, 1.0, denom)
        q_smem[...] = (acc * lax.broadcast_in_dim(v_scale / denom, (rows, head_dim), [0])
                       ).astype(q_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem, o_ref.at[kh, tile])
        plgpu.wait_smem_to_gmem(0)


# ------------------------------------------------------------------------------------ call build


def _interpret_params():
    """Pallas' GPU interpreter (CPU): its parameters live in a private module of this JAX."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()


def _swizzled(dtype, head_dim: int) -> tuple:
    """Tiles of 8 rows swizzled in 128-byte rows (64 for a 64-byte row of fp8): the layout
    warpgroup MMAs read shared memory in, and the bulk copies fill."""
    swizzle = min(128, head_dim * jnp.dtype(dtype).itemsize)
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
            plgpu.SwizzleTransform(swizzle))


def _build(num_tiles: int, kv_heads: int, head_dim: int, dtype, pool_dtype, *, groups: int,
           page: int, pages_per_step: int, num_stages: int, scale: float, v_scale: float,
           interpret: bool):
    keys = page * pages_per_step
    transforms, pool_transforms = _swizzled(dtype, head_dim), _swizzled(pool_dtype, head_dim)
    # an fp8 pool's pages land in fp8 slots and are widened into one MMA operand each for K, V
    wide = (plgpu.SMEM((keys, head_dim), dtype, transforms=transforms),) * 2 if (
        jnp.dtype(pool_dtype) != jnp.dtype(dtype)) else ()
    kernel = functools.partial(_kernel, groups=groups, pages_per_step=pages_per_step,
                               num_stages=num_stages, scale=scale, v_scale=v_scale,
                               interpret=interpret)
    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((kv_heads, num_tiles, TILE_ROWS, head_dim), dtype),
        scratch_types=(
            plgpu.SMEM((TILE_ROWS, head_dim), dtype, transforms=transforms),
            plgpu.SMEM((num_stages, keys, head_dim), pool_dtype, transforms=pool_transforms),
            plgpu.SMEM((num_stages, keys, head_dim), pool_dtype, transforms=pool_transforms),
            plgpu.Barrier(),
            plgpu.Barrier(num_arrivals=pages_per_step, num_barriers=num_stages),
            plgpu.Barrier(num_arrivals=pages_per_step, num_barriers=num_stages),
            *wide,
        ),
        grid=(num_tiles, kv_heads),
        grid_names=("tile", "kv"),
        # Pinned, not inherited: JAX 0.11 changed Mosaic GPU's default from lane to warpgroup.
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=_interpret_params() if interpret else None,
    )


# ---------------------------------------------------------------------------------- public entry


@functools.partial(jax.jit, static_argnames=("pages_per_step", "num_stages", "interpret",
                                             "scale", "k_scale", "v_scale"))
def ragged_paged_attention_mosaic(
    q: jax.Array,  # (T, N, H)
    k_pages: jax.Array,  # (L, P, B, K, H)
    v_pages: jax.Array,  # (L, P, B, K, H)
    layer: jax.Array,  # () int32
    md: AttentionMetadata,
    *,
    scale: float | None = None,
    window: jax.Array | int | None = None,
    pages_per_step: int = 4,
    num_stages: int = 3,
    interpret: bool = False,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> jax.Array:  # (T, N, H)
    """Attention of one step's ragged query rows over the paged KV pool (the contract of
    pallas.ragged_paged_attention); bfloat16 or float16, pools of q's dtype or fp8 ones,
    f32 accumulation."""
    check_attention_inputs(q, k_pages, v_pages, md, page_dtypes(q.dtype))
    t, n, h = q.shape
    page, kv_heads = k_pages.shape[2], k_pages.shape[3]
    groups = n // kv_heads
    why = supports(q.dtype, h, groups, page, pages_per_step)
    if why:
        raise ValueError(f"attention_backend 'mosaic': {why}")
    scale = (h**-0.5 if scale is None else scale) * k_scale
    tokens = aligned_tokens(groups, TILE_ROWS)
    num_tiles, tile_seq, tile_row = folded_tiles(md, t, tokens)
    call = _build(num_tiles, kv_heads, h, q.dtype, k_pages.dtype, groups=groups, page=page,
                  pages_per_step=pages_per_step, num_stages=num_stages, scale=scale,
                  v_scale=v_scale, interpret=interpret)
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    window = jnp.asarray(NO_WINDOW if window is None else window, jnp.int32).reshape(1)
    out = call(tile_seq, tile_row, md.query_start_loc, md.context_lens, md.block_tables, layer,
               window, fold_queries(q, kv_heads, TILE_ROWS), k_pages, v_pages)  # (K, NT, 64, H)
    return unfold_tiles(out, md, tokens, groups, tile_offsets(md, tile_seq, tile_row, groups))


def _not_hopper(device=None) -> str | None:
    platform = platform_of(device)
    if platform != "gpu":
        return f"it needs a Hopper GPU (sm_90a); the JAX platform here is {platform!r}"
    capability = getattr(device or jax.devices()[0], "compute_capability", "")
    if not capability.startswith("9."):
        return f"it needs a Hopper GPU (sm_90a); this device's compute capability is {capability!r}"
    return None


class MosaicBackend(Backend):
    name = AttentionBackend.MOSAIC
    table_width_free = True  # each tile walks its sequence's pages up to its last position

    def unavailable(self, *, dtype=None, head_dim=None, groups=None, block_size=None,
                    kv_dtype=None, device=None):
        why = pool_of_model_dtype(dtype, kv_dtype, fp8=True) or _not_hopper(device)
        if why is None and IMPORT_ERROR is not None:
            why = f"this JAX has no Pallas Mosaic GPU backend ({IMPORT_ERROR})"
        if why is None and None not in (dtype, head_dim, groups, block_size):
            why = supports(dtype, head_dim, groups, block_size)
        return why

    def fn(self):
        return ragged_paged_attention_mosaic


BACKEND = MosaicBackend()
