"""Every Pallas GPU kernel the engine can pick lowers for CUDA (sm_90a) without a GPU, at the
engine's shapes: GQA groups 1, 3, 4 and 8, head_dim 64 and 128, block size 16, bfloat16 and
float16 (and float32 for the Triton-lowered kernel), over decode-only, prefill-only and mixed
ragged batches; and over fp8 pools (kv_cache_dtype fp8, fp8_e5m2) with their scales.

Lowering runs each GPU backend's own checks that the interpreter skips (Mosaic GPU's layout
inference, e.g. that a bulk copy into tiled shared memory starts on a tile boundary), and the
test asserts that the kernel's custom call is in the lowered module.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

from jaxserve.kernels.attention.mosaic import ragged_paged_attention_mosaic
from jaxserve.kernels.attention.pallas import ragged_paged_attention
from tests.kernels.test_attention import LAYER, make_case

KERNELS = {  # backend -> (kernel, what its lowered module must call)
    "mosaic": (ragged_paged_attention_mosaic, "stablehlo.custom_call @mosaic_gpu"),
    "pallas": (ragged_paged_attention, "stablehlo.custom_call @__gpu$xla.gpu.triton"),
}
# (query rows, context length) per sequence: decode rows at contexts inside and on block
# boundaries, prompt chunks from part of a tile to several tiles, and both at once
BATCHES = {
    "decode": [(1, 1), (1, 17), (1, 40), (1, 16), (1, 33), (1, 81), (1, 64)],
    "one": [(1, 40)],  # cut to its one row: G folded rows, not a multiple of 8
    "prefill": [(7, 7), (16, 16), (33, 33), (65, 65), (20, 40), (129, 160)],
    "mixed": [(1, 1), (1, 17), (7, 40), (16, 16), (17, 33), (1, 32), (33, 64), (65, 65), (2, 81)],
}
BLOCK_SIZE = 16


@contextlib.contextmanager
def hopper():
    """Lower for an H200 on a machine without one. JAX 0.11's Triton lowering reads the target
    from the abstract mesh's device and refuses to guess; 0.10 assumed sm_90 by itself. Mosaic
    GPU takes sm_90a for a device that reports no compute capability."""
    device = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    with use_abstract_mesh(AbstractMesh((), (), abstract_device=device)):
        yield


def lower_for_cuda(backend: str, groups: int, head_dim: int, dtype: str, batch: str,
                   window: int | None = None, kv_dtype: str | None = None) -> str:
    """`window`: a sliding window, traced (as a scanned model of local and global layers
    passes it). `kv_dtype`: an fp8 pool, read with scales, instead of one of `dtype`."""
    kernel, _ = KERNELS[backend]
    q, k, v, md, _ = make_case(0, BATCHES[batch], kv_heads=2, groups=groups, dtype=dtype,
                               block_size=BLOCK_SIZE, head_dim=head_dim)
    if kv_dtype is not None:
        k, v = k.astype(kv_dtype), v.astype(kv_dtype)
        kernel = functools.partial(kernel, k_scale=2.0, v_scale=0.5)
    if batch == "one":  # the step of a single decode, no padding rows
        q = q[:1]
        md = dataclasses.replace(md, positions=md.positions[:1], token_seq=md.token_seq[:1],
                                 slot_mapping=md.slot_mapping[:1])
    f = jax.jit(lambda q, k, v, md, w: kernel(q, k, v, LAYER, md, window=w))
    w = None if window is None else jnp.int32(window)
    with hopper():
        return f.trace(q, k, v, md, w).lower(lowering_platforms=("cuda",)).as_text()


CASES = [  # the pallas kernel also serves float32 models
    (backend, groups, head_dim, dtype, batch)
    for backend in KERNELS
    for groups in (1, 3, 4, 8)
    for head_dim in (64, 128)
    for dtype in ("bfloat16", "float16") + (("float32",) if backend == "pallas" else ())
    for batch in BATCHES
]


@pytest.mark.parametrize("backend, groups, head_dim, dtype, batch", CASES)
def test_gpu_kernel_lowers_for_hopper(backend, groups, head_dim, dtype, batch):
    text = lower_for_cuda(backend, groups, head_dim, dtype, batch)
    assert text.count(KERNELS[backend][1]) == 1
    if backend == "pallas":
        assert 'name = "ragged_paged_attention"' in text


@pytest.mark.parametrize("backend", KERNELS)
def test_gpu_kernel_lowers_for_hopper_with_a_sliding_window(backend):
    text = lower_for_cuda(backend, 3, 64, "bfloat16", "mixed", window=24)
    assert text.count(KERNELS[backend][1]) == 1


@pytest.mark.parametrize("backend, groups, head_dim, kv_dtype", [
    (backend, groups, head_dim, kv_dtype)
    for backend in KERNELS
    for groups, head_dim in ((1, 64), (3, 128), (8, 128))
    for kv_dtype in ("float8_e4m3fn", "float8_e5m2")])
def test_gpu_kernel_lowers_for_hopper_over_an_fp8_pool(backend, groups, head_dim, kv_dtype):
    text = lower_for_cuda(backend, groups, head_dim, "bfloat16", "mixed", kv_dtype=kv_dtype)
    assert text.count(KERNELS[backend][1]) == 1
