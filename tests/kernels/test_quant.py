"""GGUF blocks kept quantized: decoded exactly as gguf dequantizes them, expanded identically in
numpy and inside a jitted step, and an engine on them gives the float weights' exact outputs."""

from __future__ import annotations

import os

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize
from safetensors.numpy import load_file

from jaxserve import EngineConfig, LLMEngine, SamplingParams
from jaxserve.kernels import quant
from jaxserve.models.llama import HEAD_BLOCKS, LAYER_BLOCKS
from jaxserve.models.loader import default_model_path, load_model
from jaxserve.testing.tiny import write_tiny_llama
from tests.models.test_loader import _write_tiny_gguf


def test_every_block_tensor_of_the_default_gguf_decodes_exactly():
    reader = gguf.GGUFReader(default_model_path())
    kinds = set()
    for t in reader.tensors:
        blocks = quant.decode(t.data, t.tensor_type.name, tuple(int(n) for n in t.shape[::-1]))
        if t.tensor_type.name in ("F32", "F16"):
            assert blocks is None
            continue
        kinds.add(t.tensor_type.name)
        want = gguf_dequantize(t.data, t.tensor_type)
        np.testing.assert_array_equal(blocks.dequantize(), want, err_msg=t.name)
        assert blocks.q.dtype == np.int8 and blocks.scale.shape == (want.shape[0],
                                                                    want.shape[1] // 32)
    assert kinds == {"Q4_1", "Q8_0"}


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_each_kept_type_decodes_exactly(kind):
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((12, 96)) * rng.uniform(0.01, 3, (12, 1))).astype(np.float32)
    t = gguf.GGMLQuantizationType[kind]
    raw = quantize(w, t)
    blocks = quant.decode(raw, kind, w.shape)
    np.testing.assert_array_equal(blocks.dequantize(), gguf_dequantize(raw, t))
    lo, hi = {"Q4_0": (-8, 7), "Q4_1": (0, 15), "Q8_0": (-128, 127)}[kind]
    assert lo <= blocks.q.min() and blocks.q.max() <= hi


# Each type's float16 fields (byte offsets in its block); every other byte may be anything.
HALVES = {"Q5_0": (0,), "Q5_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Raw GGUF bytes of a (rows, cols) tensor of `kind`: random codes, scales and bits, and
    finite float16 scales of either sign and many magnitudes."""
    rng = np.random.default_rng(seed)
    size, per = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    raw = rng.integers(0, 256, (rows * cols // size, per), dtype=np.uint8)
    for at in HALVES[kind]:
        d = (rng.standard_normal(len(raw)) * 10.0 ** rng.integers(-6, 2, len(raw)))
        raw[:, at:at + 2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind", ["Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"])
def test_each_block_and_k_quant_type_decodes_exactly(kind):
    """Random blocks (every code, sub-block scale and minimum bit pattern), decoded into blocks
    of 32 (Q6_K: 16) along the row: bit for bit what gguf's own dequantize gives."""
    raw = random_blocks(kind, 6, 512)
    blocks = quant.decode(raw, kind, (6, 512))
    want = gguf_dequantize(raw, gguf.GGMLQuantizationType[kind])
    np.testing.assert_array_equal(blocks.dequantize(), want)
    lo, hi = {"Q5_0": (-16, 15), "Q5_1": (0, 31), "Q4_K": (0, 15), "Q5_K": (0, 31),
              "Q6_K": (-32, 31)}[kind]
    assert blocks.q.min() == lo and blocks.q.max() == hi
    block = 16 if kind == "Q6_K" else 32
    assert blocks.scale.dtype == np.float32 and blocks.scale.shape == (6, 512 // block)
    assert blocks.block == block
    np.testing.assert_array_equal(blocks.halved().dequantize(), want)  # as blocks of 16


def test_types_and_shapes_not_kept():
    assert quant.decode(np.zeros((4, 66), np.uint8), "TQ2_0", (4, 256)) is None
    assert quant.decode(np.zeros((4, 40), np.uint8), "Q8_0", (4, 40)) is None  # cols % 32


@pytest.mark.parametrize("shape,axis", [((64, 3, 8), 0), ((3, 64, 8), 1), ((5, 96), 1)])
def test_expanding_in_the_step_matches_numpy(shape, axis):
    """Any block axis; jitted, as the model does it; and cast to a narrower compute dtype."""
    rng = np.random.default_rng(1)
    scale_shape = tuple(n // 32 if i == axis else n for i, n in enumerate(shape))
    w = {"q": rng.integers(-128, 128, shape).astype(np.int8),
         "scale": rng.uniform(1e-3, 1, scale_shape).astype(np.float16).astype(np.float32),
         "min": rng.uniform(-1, 0, scale_shape).astype(np.float16).astype(np.float32)}
    assert quant.block_axis(w) == axis
    want = quant.dequantize_np(w)
    # Block by block: q * scale + min with the block's own scale.
    idx = [slice(None)] * len(shape)
    idx[axis] = slice(32, 64)
    sidx = list(idx)
    sidx[axis] = slice(1, 2)
    np.testing.assert_array_equal(want[tuple(idx)], w["q"][tuple(idx)].astype(np.float32)
                                  * w["scale"][tuple(sidx)] + w["min"][tuple(sidx)])
    got = jax.jit(quant.dequantize, static_argnums=1)(w, jnp.float32)
    np.testing.assert_array_equal(np.asarray(got), want)
    half = quant.dequantize(w, jnp.bfloat16)
    assert half.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(half), want.astype(jnp.bfloat16))
    assert quant.dequantize(want, jnp.float32) is want  # a float param passes through


def test_planes_that_do_not_differ_by_a_block_are_refused():
    bad = {"q": np.zeros((64, 8), np.int8), "scale": np.zeros((64, 8), np.float32),
           "min": np.zeros((64, 8), np.float32)}
    with pytest.raises(ValueError, match=r"32x \(or 16x\) along exactly one axis"):
        quant.block_axis(bad)


@pytest.fixture(scope="module")
def tiny_q4_gguf(tmp_path_factory, tiny_llama_dir):
    d = tmp_path_factory.mktemp("tiny-q")
    tensors = load_file(os.path.join(tiny_llama_dir, "model.safetensors"))
    cfg = load_model(tiny_llama_dir).config
    _write_tiny_gguf(d / "tiny-q4.gguf", tensors, cfg,
                     {"proj.weight": "Q4_1", "down_proj.weight": "Q8_0"})
    return str(d / "tiny-q4.gguf")


def _run(model: str, **kw):
    engine = LLMEngine(EngineConfig(model=model, max_num_seqs=4, max_num_batched_tokens=64,
                                    max_model_len=256, num_kv_blocks=64, **kw))
    rng = np.random.default_rng(5)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    for i, n in enumerate((5, 40, 17)):
        engine.add_request(f"r{i}", None, params, prompt_token_ids=rng.integers(
            3, 500, int(n)).tolist())
    out = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                c = o.outputs[0]
                out[o.request_id] = (c.token_ids, c.logprobs)
    assert engine.block_manager.num_used_blocks == 0
    return engine, out


def test_engine_on_kept_blocks_gives_the_float_weights_outputs(tiny_q4_gguf):
    """quantization=auto (blocks on the device) and none (expanded at load): the same tokens
    and the same logprobs (to the bit where the step expands the blocks; within 2e-3 where
    the CPU block-matmul kernel reads them, with x scaled to int16 per block of 32). This
    random model amplifies the scaling's error: 7e-4 and 1.04e-3 measured at most, from two
    orders of summing a block of x, whose products differ by 4e-8 of their size. The params
    take about a quarter of the bytes, or less where the kernel reads Q4's codes as
    nibbles."""
    kept, got = _run(tiny_q4_gguf)
    expanded, want = _run(tiny_q4_gguf, quantization="none")
    assert [g[0] for g in got.values()] == [w[0] for w in want.values()]
    if kept.runner.block_matmul is None:
        assert got == want
    for (_, got_lp), (_, want_lp) in zip(got.values(), want.values(), strict=True):
        for g, w in zip(got_lp, want_lp, strict=True):  # {"logprob", "top": {id: lp}}
            assert g["top"].keys() == w["top"].keys()
            np.testing.assert_allclose([g["logprob"], *g["top"].values()],
                                       [w["logprob"], *(w["top"][t] for t in g["top"])],
                                       atol=2e-3)
    assert expanded.runner.block_matmul is None
    assert (kept.runner.block_matmul is not None) == (jax.default_backend() == "cpu")
    packed = kept.runner.block_matmul is not None
    # The scanned step reads the kernel's stacks whole at each layer's index, held apart from
    # the params each iteration slices (models/llama.py's split_layer_blocks).
    held = kept.runner.params.get(LAYER_BLOCKS, {})
    assert ("w_up" in held) == packed != ("w_up" in kept.runner.params["layers"])
    kept_layers = {**kept.runner.params["layers"], **held}
    assert quant.is_quantized(kept_layers["w_up"])
    assert not quant.is_quantized(expanded.runner.params["layers"]["w_up"])
    # The kernel reads Q4's codes two to a byte with float16 scales (0.625 bytes a weight),
    # and so does the step without it (kernels/gpu_matmul.py's form).
    assert quant.is_nibbles(kept_layers["w_up"]) == packed
    nbytes = lambda p: sum(a.nbytes for a in jax.tree.leaves(p))  # noqa: E731
    layers = kept_layers, expanded.runner.params["layers"]
    assert nbytes(layers[0]["w_up"]) / nbytes(layers[1]["w_up"]) == 0.625 / 4
    assert nbytes(layers[0]) < 0.4 * nbytes(layers[1])


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 (forced) devices")
def test_kept_blocks_unrolled_and_split_over_devices(tiny_q4_gguf):
    """Unrolled layers slice each plane per layer; tensor parallelism splits each plane like
    its weight (kv heads replicated at tp 4). The same tokens as the scanned single device."""
    _, want = _run(tiny_q4_gguf)
    for tp in (1, 2, 4):
        _, got = _run(tiny_q4_gguf, layer_loop="unroll", tensor_parallel_size=tp)
        assert [g[0] for g in got.values()] == [w[0] for w in want.values()]


def test_the_default_embedding_comes_back_to_its_own_q8_blocks():
    """The Q8_0 embedding is expanded at load; requantize_q8 finds its blocks again, to the
    bit (the CPU kernel's head reads those), and declines weights that are not such blocks."""
    reader = gguf.GGUFReader(default_model_path())
    t = next(t for t in reader.tensors if t.name == "token_embd.weight")
    blocks = quant.decode(t.data, t.tensor_type.name, tuple(int(n) for n in t.shape[::-1]))
    table = blocks.dequantize()  # (V, D), as the loader gives it
    again = quant.requantize_q8(table.T, 0)  # (D, V): blocks along D
    np.testing.assert_array_equal(again["q"], blocks.q.T)
    np.testing.assert_array_equal(again["scale"], blocks.scale.T)
    assert not again["min"].any()
    np.testing.assert_array_equal(quant.dequantize_np(again), table.T)
    assert quant.requantize_q8(table[:, :48], 1) is None  # not whole blocks
    assert quant.requantize_q8(table * np.float32(1.0001), 1) is None


# Every kept type that is not the default model's, on layer projections whose rows are whole
# K-quant super-blocks (hidden 256, intermediate 512).
# As in a Q4_K_M file, one layer's down and v projections are Q6_K and the other's are not:
# their stacks keep blocks of 16; the output matrix is Q6_K, the embedding Q4_K.
K_MODEL_TYPES = {"layers.1.mlp.down_proj.weight": "Q6_K", "layers.0.self_attn.v_proj.weight":
                 "Q6_K", "q_proj.weight": "Q4_K", "k_proj.weight": "Q5_K",
                 "v_proj.weight": "Q5_0", "o_proj.weight": "Q5_1", "gate_proj.weight": "Q4_K",
                 "up_proj.weight": "Q6_K", "down_proj.weight": "Q4_K",
                 "lm_head.weight": "Q6_K", "embed_tokens.weight": "Q4_K"}


@pytest.fixture(scope="module")
def tiny_k_gguf(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-k")
    (d / "hf").mkdir()
    src = write_tiny_llama(d / "hf", 512, seed=3, hidden_size=256, intermediate_size=512)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    _write_tiny_gguf(d / "tiny-k.gguf", tensors, load_model(src).config, K_MODEL_TYPES)
    return str(d / "tiny-k.gguf")


def test_k_quant_model_keeps_its_blocks_and_matches_hf(tiny_k_gguf, caplog):
    """A GGUF of K-quant and 5-bit projections, some stacks mixing Q6_K layers with others:
    loaded without expanding any (no warning), and the engine's greedy tokens equal HF
    transformers' on the same file (which dequantizes them with gguf)."""
    from jaxserve.testing.oracle import load_hf_model
    from tests.models.test_hf_equivalence import hf_greedy

    with caplog.at_level("WARNING", logger="jaxserve.models.loader"):
        params = load_model(tiny_k_gguf).params
    layers = params["layers"]
    assert all(quant.is_quantized(layers[k]) for k in ("wq", "wk", "wv", "wo", "w_gate",
                                                       "w_up", "w_down"))
    assert "expanded to float32" not in caplog.text
    assert quant.block_of(layers["w_down"]) == quant.block_of(layers["wv"]) == 16
    assert quant.block_of(layers["w_gate"]) == 32
    # the output matrix's own Q6_K blocks, (D, V), beside its float form
    head = params[HEAD_BLOCKS]
    assert head["q"].shape == (256, 512) and quant.block_of(head) == 16
    np.testing.assert_array_equal(quant.dequantize_np(head), params["lm_head"])
    engine, got = _run(tiny_k_gguf)
    assert (engine.runner.block_matmul is not None) == (jax.default_backend() == "cpu")
    if engine.runner.block_matmul is not None:  # the kernel reads the blocks of 16 in place
        from jaxserve.kernels import cpu_matmul

        held = {**engine.runner.params["layers"], **engine.runner.params.get(LAYER_BLOCKS, {})}
        cfg = engine.runner.model_config
        shape = (cfg.intermediate_size, cfg.hidden_size)
        # w_down mixes a Q4_K layer and a Q6_K one: two stacks, each in its own form
        down = held["w_down"]
        assert quant.is_split(down) and down["slot"].tolist() == [0, -1]
        assert cpu_matmul._form(down["parts"]["b32"])[0] == cpu_matmul.TARGET_NIBBLES_SUPER
        assert cpu_matmul._form(down["parts"]["b16"])[0] == cpu_matmul.TARGET_SIX_HALF
        assert all(cpu_matmul.fits(p, 1, shape, stacked=True) for p in down["parts"].values())
        # wv: Q6_K, then Q5_0 (six-bit codes in blocks of 32)
        assert [cpu_matmul._form(held["wv"]["parts"][p])[0] for p in ("b32", "b16")] == [
            cpu_matmul.TARGET_SIX, cpu_matmul.TARGET_SIX_HALF]
        assert cpu_matmul._form(held["w_gate"])[0] == cpu_matmul.TARGET_NIBBLES_SUPER  # Q4_K
        assert cpu_matmul._form(held["w_up"])[0] == cpu_matmul.TARGET_SIX_HALF  # Q6_K
        # the head's blocks as the file has them; the float copy is not kept
        head = engine.runner.params[HEAD_BLOCKS]
        assert cpu_matmul._form(head)[0] == cpu_matmul.TARGET_SIX_HALF
        assert "lm_head" not in engine.runner.params
    hf = load_hf_model(tiny_k_gguf)
    rng = np.random.default_rng(5)  # _run's prompts
    for i, n in enumerate((5, 40, 17)):
        prompt = rng.integers(3, 500, int(n)).tolist()
        assert got[f"r{i}"][0] == hf_greedy(hf, prompt, 12), i


def test_expanding_a_type_not_kept_warns_with_its_bytes(tmp_path, caplog):
    """TQ2_0 (llama.cpp's ternary super-blocks) is one of the types expanded at load."""
    src = write_tiny_llama(tmp_path, 512, seed=3, hidden_size=256, intermediate_size=512)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    _write_tiny_gguf(tmp_path / "q.gguf", tensors, load_model(src).config,
                     {"down_proj.weight": "Q5_0", "up_proj.weight": "TQ2_0"})
    with caplog.at_level("WARNING", logger="jaxserve.models.loader"):
        params = load_model(str(tmp_path / "q.gguf")).params["layers"]
    assert quant.is_quantized(params["w_down"]) and not quant.is_quantized(params["w_up"])
    # 2 layers of (512, 256): 0.5 MB each as float32, 66 bytes per 256 values in the file
    assert "TQ2_0 2 tensors, 0.1 MB in the file -> 1.0 MB" in caplog.text, caplog.text
