"""GGUF blocks in the GPU form (kernels/gpu_matmul.py): the same weights as the file's blocks,
the kernel's product (interpreted on the CPU) equal to the reference's, its lowering for CUDA,
and an engine on the GPU form (its step's reference path on the CPU) giving the tokens of the
expanded weights."""

from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf.quants import dequantize as gguf_dequantize

from jaxserve.bench.gpu_cost import GGUF_GPU_FORMS
from jaxserve.kernels import gpu_matmul, quant
from tests.kernels.test_gpu_lowering import hopper
from tests.kernels.test_quant import HALVES, _run, tiny_q4_gguf  # noqa: F401 (a fixture)

KINDS = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q6_K")
SCALES = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2)} | HALVES  # float16 fields of a block


def random_blocks(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Raw GGUF bytes of a (rows, cols) tensor of `kind`: random codes and bits, finite
    float16 scales of either sign and many magnitudes."""
    rng = np.random.default_rng(seed)
    size, per = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    raw = rng.integers(0, 256, (rows * cols // size, per), dtype=np.uint8)
    for at in SCALES[kind]:
        d = rng.standard_normal(len(raw)) * 10.0 ** rng.integers(-6, 2, len(raw))
        raw[:, at:at + 2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def gpu_weight(kind: str, n: int = 96, k: int = 512, seed: int = 0):
    """A (k, n) projection of `kind` (the file's (n, k) tensor, transposed as the loader lays
    projections out) in the GPU form, and the file's own values of it."""
    raw = random_blocks(kind, n, k, seed)
    blocks = quant.decode(raw, kind, (n, k)).map(lambda a: a.T)
    want = gguf_dequantize(raw, gguf.GGMLQuantizationType[kind]).T
    return gpu_matmul.gpu_form(blocks.planes()), want


@pytest.mark.parametrize("kind", KINDS)
def test_gpu_form_holds_the_files_values(kind):
    """Bit for bit what gguf dequantizes, in the planes the deviceless cost takes for the type
    (gpu_cost.GGUF_GPU_FORMS): half-precision scales only where they are exact."""
    w, want = gpu_weight(kind)
    np.testing.assert_array_equal(quant.dequantize_np(quant.gpu_to_int8_form(w)), want)
    got = np.asarray(quant.dequantize(w, jnp.float32))  # as the step forms it
    np.testing.assert_array_equal(got, want)
    codes, code_dtype, scale_dtype, min_dtype = GGUF_GPU_FORMS[kind]
    assert w[codes].dtype == code_dtype and w["scale"].dtype == scale_dtype
    assert (w["min"].dtype if "min" in w else None) == min_dtype
    rows = 512 // 2 if codes == "g4" else 512
    assert w[codes].shape == (rows, 96) and gpu_matmul.block_of(w) == (16 if kind == "Q6_K"
                                                                       else 32)


def test_gpu_form_of_stacked_layers_and_a_two_axis_contraction():
    """wo (L, N, H, D), blocks along H: planes (L, N * H, D), each layer its own weight."""
    rng = np.random.default_rng(1)
    q = rng.integers(-128, 128, (2, 4, 64, 48)).astype(np.int8)
    scale = rng.standard_normal((2, 4, 2, 48)).astype(np.float16).astype(np.float32)
    w = {"q": q, "scale": scale, "min": np.zeros_like(scale)}
    g = gpu_matmul.gpu_form(w, batch_dims=1)
    assert g["g8"].shape == (2, 256, 48) and g["scale"].dtype == np.float16
    want = quant.dequantize_np(w).reshape(2, 256, 48)
    np.testing.assert_array_equal(quant.dequantize_np(quant.gpu_to_int8_form(g)), want)
    tree = {"layers": {"wo": w, "input_norm": {"weight": np.ones((2, 48))}}, "embed": q}
    gpu_matmul.to_gpu_forms(tree)
    assert gpu_matmul.is_gpu_form(tree["layers"]["wo"]) and tree["embed"] is q


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("m", [1, 19, 64])
def test_kernel_matches_the_reference(kind, m):
    """The kernel (interpreted) against x @ the dequantized weight: float32 sums of the same
    bfloat16 products, in another order."""
    w, _ = gpu_weight(kind, n=96, k=512, seed=m)
    w = {k: jnp.asarray(v) for k, v in w.items()}
    x = jnp.asarray(np.random.default_rng(m).standard_normal((m, 512)), jnp.bfloat16)
    got = gpu_matmul.block_matmul(x, w, interpret=True)
    want = jnp.dot(x, quant.dequantize(w, jnp.bfloat16), preferred_element_type=jnp.float32)
    assert got.shape == (m, 96) and got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.float32(got), np.float32(want),
                               rtol=1e-2, atol=1e-2 * float(jnp.abs(want).max()))
    np.testing.assert_array_equal(np.float32(gpu_matmul.matmul(x, w)),  # on the CPU: reference
                                  np.float32(gpu_matmul.block_matmul_reference(x, w)))


def test_bad_shapes_are_refused():
    w, _ = gpu_weight("Q8_0")
    with pytest.raises(ValueError, match="block_matmul"):
        gpu_matmul.block_matmul(jnp.zeros((4, 256), jnp.bfloat16), w, interpret=True)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_K"])
def test_kernel_lowers_for_hopper(kind):
    w, _ = gpu_weight(kind)
    x = jnp.zeros((64, 512), jnp.bfloat16)
    with hopper():
        text = jax.jit(gpu_matmul.matmul).trace(x, w).lower(
            lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.custom_call @__gpu$xla.gpu.triton") == 1
    assert 'name = "gguf_block_matmul"' in text


def test_engine_on_the_gpu_form_gives_the_expanded_weights_tokens(tiny_q4_gguf):  # noqa: F811
    """bfloat16 on the CPU: no CPU block kernel, so the runner's path off the CPU, which puts
    the layer projections in the GPU form (the step reads them through gpu_matmul.matmul,
    whose reference runs here). The same weights as expanding at load, so the same tokens and
    logprobs, in 0.625 bytes a Q4_1 weight instead of 2."""
    kept, got = _run(tiny_q4_gguf, dtype="bfloat16")
    expanded, want = _run(tiny_q4_gguf, dtype="bfloat16", quantization="none")
    assert kept.runner.block_matmul is None
    assert got == want
    layers = kept.runner.params["layers"]
    w_up = layers["w_up"]  # Q4_1: unsigned nibbles, float16 scales and minima
    assert gpu_matmul.is_gpu_form(w_up) and w_up["g4"].dtype == jnp.uint8
    assert w_up["scale"].dtype == w_up["min"].dtype == jnp.float16
    nbytes = lambda p: sum(a.nbytes for a in jax.tree.leaves(p))  # noqa: E731
    ratio = nbytes(layers["w_up"]) / nbytes(expanded.runner.params["layers"]["w_up"])
    assert ratio == 0.625 / 2
