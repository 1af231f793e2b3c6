"""Matmuls on weights kept in GGUF blocks, as a C++ kernel for CPUs called through XLA's FFI.

`models/quant.py` keeps a GGUF's projections as int8 codes with a float32 scale and minimum per
block of 32 inputs. The jnp path expands such a weight to float32 in memory before its dot, so
a step writes and reads the expanded weights on top of streaming the codes. The kernel
(`cpu/block_matmul.cc`) never makes float weights: it scales each block of 32 values of a row
of x to int16 and multiplies the codes on integers, two products per int32 lane (AVX-512
VNNI's vpdpwssd where the CPU has it), then applies the block's scales in float32. Scaling x
moves each value by at most 2^-16 of its block's largest; the engine's greedy tokens still
equal HF transformers' (tests/models/test_hf_equivalence.py) and its logprobs stay within
~1e-4 of the float path's.

Against the previous kernel (float32 weights expanded per block into L1), a 30-layer stack of
576x1536 products at 32 rows took 10.2-10.7 ms instead of 13.6-15.3, and the full decode
forward at 32 sequences 70-74 ms instead of 78-81 (best of 40; see the README for the engine).
"""
from __future__ import annotations

import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp

from kernels.cpu_library import library
from models import quant

TARGET = "jaxserve_block_matmul"
PANEL = 32  # columns of y per work item: N must be a multiple


def available() -> str | None:
    """Why the kernel cannot run here, or None."""
    lib = library()
    return lib if isinstance(lib, str) else None


def fits(w: Mapping, contract: int) -> bool:
    """Whether quantized weight `w`, contracted over its first `contract` axes, has the layout
    the kernel reads: float32 planes, blocks along the last contracted axis (so the rows of k
    group into whole blocks), and a multiple of PANEL outputs."""
    if not quant.is_quantized(w) or w["scale"].dtype != jnp.float32:
        return False
    outputs = math.prod(w["q"].shape[contract:])
    return quant.block_axis(w) == contract - 1 and outputs % PANEL == 0


def block_matmul(x: jax.Array, w: Mapping, contract: int = 1) -> jax.Array:
    """x (M, prod(w.shape[:contract])) float32 @ the weight `w` (a quantized dict, see
    models/quant.py) -> (M, *w.shape[contract:]) float32."""
    if not fits(w, contract):
        raise ValueError(f"block_matmul cannot read a weight of planes "
                         f"{ {k: (a.shape, a.dtype.name) for k, a in w.items()} } "
                         f"contracted over {contract} axes")
    why = available()
    if why:
        raise ValueError(f"the cpu block matmul kernel cannot run: {why}")
    shape = w["q"].shape
    k, outputs = math.prod(shape[:contract]), shape[contract:]
    n = math.prod(outputs)
    if x.ndim != 2 or x.shape[1] != k or x.dtype != jnp.float32:
        raise ValueError(f"block_matmul needs x of shape (M, {k}) float32, got {x.shape} "
                         f"{x.dtype}")
    planes = {name: a.reshape(-1, n) for name, a in w.items()}  # (K, N), (K / 32, N) x 2
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))
    y = call(x, planes["q"], planes["scale"], planes["min"])
    return y.reshape(x.shape[0], *outputs)


def block_matmul_or_none(x: jax.Array, w, contract: int = 1) -> jax.Array | None:
    """block_matmul where x and w are what it reads, else None (models/llama.py's
    BlockMatmulFn: the step then expands the weight and runs the dot)."""
    if x.dtype != jnp.float32 or not fits(w, contract):
        return None
    return block_matmul(x, w, contract)
