"""FP8 weights: each scale form dequantizes exactly, the checkpoint's scales follow the
loader's layout, and configs this module cannot read are refused by field."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxserve.kernels import fp8, quant

E4M3 = ml_dtypes.float8_e4m3fn


def codes(rng, shape):
    return np.clip(rng.standard_normal(shape) * 100, -448, 448).astype(E4M3)


def reference(c: np.ndarray, scale_of) -> np.ndarray:
    """Element by element: float32(code) * its scale, rounded once in float32."""
    out = np.empty(c.shape, np.float32)
    for r, k in np.ndindex(*c.shape):
        out[r, k] = np.float32(float(c[r, k])) * np.float32(scale_of(r, k))
    return out


def test_block_scales_dequantize_exactly():
    rng = np.random.default_rng(0)
    c = codes(rng, (200, 320))  # partial tiles on both axes
    inv = rng.uniform(1e-4, 1e-2, (2, 3)).astype(np.float32)
    w = fp8.from_checkpoint("w", c, inv, fp8.Scheme("fp8", "weight_scale_inv", (128, 128)))
    assert w.scale.shape == (200, 5)  # a scale per row and per 64 inputs (gcd(128, 320))
    expect = reference(c, lambda r, k: inv[r // 128, k // 128])
    assert np.array_equal(w.dequantize(), expect)
    assert np.array_equal(np.asarray(quant.dequantize(w.planes(), jnp.float32)), expect)


@pytest.mark.parametrize("shape", [(48, 1), (48,)])
def test_channel_scales_dequantize_exactly(shape):
    rng = np.random.default_rng(1)
    c = codes(rng, (48, 40))
    s = rng.uniform(1e-4, 1e-2, shape).astype(np.float32)
    w = fp8.from_checkpoint("w", c, s, fp8.Scheme("compressed-tensors", "weight_scale", None))
    expect = reference(c, lambda r, k: s.reshape(-1)[r])
    assert np.array_equal(w.dequantize(), expect)
    assert np.array_equal(np.asarray(fp8.dequantize(w.planes(), jnp.float32)), expect)


@pytest.mark.parametrize("scale", [np.float32(0.0123), np.array([0.0123], np.float32)])
def test_tensor_scale_dequantizes_exactly(scale):
    c = codes(np.random.default_rng(2), (16, 24))
    w = fp8.from_checkpoint("w", c, scale, fp8.Scheme("compressed-tensors", "weight_scale",
                                                      None))
    assert np.array_equal(w.dequantize(), reference(c, lambda r, k: 0.0123))


def test_layout_changes_keep_the_scales_with_their_weights():
    """Transposed and split into heads as the loader lays wo out, with blocks cut to a head."""
    rng = np.random.default_rng(3)
    c = codes(rng, (64, 4 * 48))  # o_proj: (D, N * H), 4 heads of 48
    inv = rng.uniform(1e-4, 1e-2, (1, 2)).astype(np.float32)
    w = fp8.from_checkpoint("w", c, inv, fp8.Scheme("fp8", "weight_scale_inv", (128, 128)))
    w = w.with_block(16).map(lambda a: a.T.reshape(4, -1, 64))  # (N, H, D)
    assert w.scale.shape == (4, 3, 64)
    full = reference(c, lambda r, k: inv[r // 128, k // 128]).T.reshape(4, 48, 64)
    assert np.array_equal(fp8.dequantize_np(w.planes()), full)


def test_bfloat16_weights_round_the_scale_then_the_product():
    rng = np.random.default_rng(4)
    w = {"fp8": codes(rng, (32, 8)), "scale": rng.uniform(0.1, 1, (1, 8)).astype(np.float32)}
    got = np.asarray(fp8.dequantize(jax.tree.map(jnp.asarray, w), jnp.bfloat16))
    # a code (4 significant bits) times a bfloat16 scale (8) is exact in float32: one rounding
    scale = w["scale"].astype(jnp.bfloat16).astype(np.float32)
    assert np.array_equal(got, (w["fp8"].astype(np.float32) * scale).astype(jnp.bfloat16))
    assert np.allclose(got.astype(np.float32), fp8.dequantize_np(w), rtol=2 ** -7)


def test_fp8_is_a_quantized_form():
    w = {"fp8": np.zeros((4, 4), E4M3), "scale": np.ones((1, 4), np.float32)}
    assert quant.is_quantized(w) and fp8.is_fp8(w) and not quant.is_blocks(w)
    assert quant.dequantize_tree({"a": {"w": w}})["a"]["w"].dtype == np.float32


@pytest.mark.parametrize("qc, field", [
    ({"quant_method": "awq"}, "quant_method"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized"}, "format"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"}}}}, "g.weights"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float",
                                          "strategy": "group"}}}}, "strategy"),
])
def test_unsupported_configs_name_the_field(qc, field):
    with pytest.raises(ValueError, match=field):
        fp8.scheme_of({"quantization_config": qc})


def test_missing_scale_tensor_is_named():
    scheme = fp8.scheme_of({"quantization_config": {"quant_method": "fp8",
                                                    "weight_block_size": [128, 128]}})
    tensors = {"model.layers.0.mlp.up_proj.weight": np.zeros((8, 8), E4M3)}
    with pytest.raises(ValueError, match=r"up_proj\.weight_scale_inv"):
        fp8.assemble(tensors, scheme)


def test_wrong_block_scale_shape_is_named():
    scheme = fp8.Scheme("fp8", "weight_scale_inv", (128, 128))
    with pytest.raises(ValueError, match=r"scale_inv has shape \(2, 2\), expected \(1, 2\)"):
        fp8.from_checkpoint("w", np.zeros((8, 200), E4M3), np.ones((2, 2), np.float32), scheme)


def test_abstract_fp8_makes_the_projections_fp8():
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
    params = {"embed": f32(512, 256), "final_norm": {"weight": f32(256)},
              "lm_head": f32(256, 512),
              "layers": {"wq": f32(2, 256, 4, 64), "wo": f32(2, 4, 64, 256),
                         "w_down": f32(2, 384, 256), "input_norm": {"weight": f32(2, 256)}}}
    out = fp8.abstract_fp8(params)
    layers = out["layers"]
    assert layers["wq"]["fp8"] == jax.ShapeDtypeStruct((2, 256, 4, 64), E4M3)
    assert layers["wq"]["scale"] == f32(2, 2, 4, 64)
    assert layers["wo"]["scale"] == f32(2, 4, 1, 256)  # blocks of 64: within a head
    assert layers["w_down"]["scale"] == f32(2, 3, 256)
    assert layers["input_norm"] is params["layers"]["input_norm"]
    assert out["embed"] is params["embed"] and out["lm_head"] is params["lm_head"]
    assert fp8.abstract_fp8(params, None)["layers"]["w_down"]["scale"] == f32(2, 1, 256)
