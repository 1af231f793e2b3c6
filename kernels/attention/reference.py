"""Reference ragged paged attention in plain jnp: the CPU path and the oracle for the kernels.

Every query token attends to its own sequence's keys at positions <= its own position, which is
causal inside a prefill chunk and full over the context cached by earlier steps. With a `window`
W (a sliding-window layer), a token at position p sees only keys in (p - W, p]: the W newest,
its own included, as HF's sliding-window mask. A pool of another dtype than q's (kv_cache_dtype)
is read in q's; an fp8 pool holds K / k_scale and V / v_scale, read back times the scale. The
keys are
gathered through the block table per token, so memory is O(T * MB * B * K * H): fine for a CPU and
for tests; the Pallas and Triton kernels read blocks in place instead.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.kernels.attention.base import AttentionBackend, Backend
from jaxserve.kernels.attention.metadata import AttentionMetadata


def ragged_paged_attention_reference(
    q: jax.Array,  # (T, N, H)
    k_pool: jax.Array,  # (L, P, B, K, H)
    v_pool: jax.Array,  # (L, P, B, K, H)
    layer: jax.Array,  # () int32
    md: AttentionMetadata,
    *,
    scale: float | None = None,
    window: jax.Array | int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> jax.Array:  # (T, N, H)
    t, n, h = q.shape
    _, _, b, kh, _ = k_pool.shape
    g = n // kh
    mb = md.block_tables.shape[1]
    scale = h**-0.5 if scale is None else scale

    tables = md.block_tables[md.token_seq]  # (T, MB)
    # (T, MB, B, K, H), in q's dtype (a pool of another dtype: kv_cache_dtype)
    k, v = widen(k_pool[layer, tables], q.dtype, k_scale), widen(v_pool[layer, tables], q.dtype,
                                                                  v_scale)
    if isinstance(layer, int):
        # A static layer (unrolled layers): XLA:CPU would fuse the gather into the dot's
        # transpose as one element-by-element loop over the pool; kept apart, the gather moves
        # whole rows and the transpose runs on a dense array, which is faster.
        k, v = jax.lax.optimization_barrier((k, v))
    k = k.reshape(t, mb * b, kh, h)  # (T, C, K, H)
    v = v.reshape(t, mb * b, kh, h)
    qg = q.reshape(t, kh, g, h)
    scores = jnp.einsum("tkgh,tckh->tkgc", qg, k, preferred_element_type=jnp.float32) * scale
    key_pos = jnp.arange(mb * b, dtype=jnp.int32)
    mask = visible(key_pos[None, :], md.positions[:, None], window)  # (T, C)
    scores = jnp.where(mask[:, None, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("tkgc,tckh->tkgh", probs.astype(v.dtype), v,
                     preferred_element_type=jnp.float32)
    return out.reshape(t, n, h).astype(q.dtype)


def widen(pages: jax.Array, dtype, scale: float = 1.0) -> jax.Array:
    """Pages read as `dtype` values: cast, then times `scale` (an fp8 pool's k_scale or
    v_scale: what kv_write.py divided by)."""
    x = pages.astype(dtype)
    return x if scale == 1.0 else x * jnp.asarray(scale, dtype)


def visible(key_pos: jax.Array, pos: jax.Array, window: jax.Array | int | None) -> jax.Array:
    """Whether a key at `key_pos` is in view of a query at `pos` (broadcast): causal, and
    within the newest `window` keys where there is one."""
    seen = key_pos <= pos
    return seen if window is None else seen & (key_pos > pos - window)


class ReferenceBackend(Backend):
    name = AttentionBackend.REFERENCE

    def fn(self):
        return ragged_paged_attention_reference


BACKEND = ReferenceBackend()
