"""EngineConfig: validation, enums, and the command-line options derived from its fields."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from jaxserve.config import EngineConfig, LayerLoop, add_options, from_options
from jaxserve.core.scheduler import PreemptionMode
from jaxserve.kernels.attention.base import AttentionBackend


def test_max_num_seqs_defaults_per_platform_within_the_budget():
    cfg = EngineConfig()
    assert cfg.max_num_seqs is None
    with pytest.raises(ValueError, match="on_platform"):
        cfg.buckets()
    assert cfg.on_platform("cpu").max_num_seqs == 16
    assert cfg.on_platform("gpu").max_num_seqs == 64
    assert EngineConfig(max_num_batched_tokens=8).on_platform("gpu").max_num_seqs == 8
    assert EngineConfig(max_num_seqs=40).on_platform("cpu").max_num_seqs == 40
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineConfig(max_num_seqs=0)


def test_decode_steps_default_per_platform_and_one_under_speculation():
    cfg = EngineConfig()
    with pytest.raises(ValueError, match="decode_steps"):
        _ = cfg.decode_loop_steps
    assert cfg.on_platform("cpu").decode_steps == 1
    assert cfg.on_platform("gpu").scheduler_config().decode_steps == 8
    assert EngineConfig(decode_steps=4).on_platform("cpu").decode_loop_steps == 4
    spec = EngineConfig(decode_steps=4, speculative_method="ngram").on_platform("gpu")
    assert spec.decode_loop_steps == 1
    for bad in (0, 65, 2.0):
        with pytest.raises(ValueError, match="decode_steps"):
            EngineConfig(decode_steps=bad)


def test_layer_loop_default_unrolls_on_an_accelerator_and_scans_on_a_cpu():
    cfg = EngineConfig()
    with pytest.raises(ValueError, match="layer_loop"):
        _ = cfg.scan_layers
    assert cfg.on_platform("cpu").scan_layers
    assert cfg.on_platform("gpu").layer_loop is LayerLoop.UNROLL
    assert EngineConfig(layer_loop="scan").on_platform("gpu").scan_layers
    with pytest.raises(ValueError, match="layer_loop"):
        EngineConfig(layer_loop="spiral")


def test_strings_become_enums_and_bad_names_are_refused():
    cfg = EngineConfig(scheduling_policy="priority", preemption_mode="swap",
                       attention_backend="reference")
    assert cfg.scheduling_policy == "priority"
    assert cfg.preemption_mode is PreemptionMode.SWAP
    assert cfg.attention_backend is AttentionBackend.REFERENCE
    assert cfg.on_platform("cpu").scheduler_config().policy == "priority"
    for field in ("scheduling_policy", "preemption_mode", "attention_backend"):
        with pytest.raises(ValueError, match=field):
            EngineConfig(**{field: "nonsense"})
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority, "
                                         "static, got 'lottery'"):
        EngineConfig(scheduling_policy="lottery")


def test_every_field_is_an_option_with_its_default_and_help():
    ap = argparse.ArgumentParser()
    add_options(ap, EngineConfig)
    actions = {a.dest: a for a in ap._actions}
    for f in dataclasses.fields(EngineConfig):
        assert f.metadata["help"], f.name
        a = actions[f.name]
        assert a.help.startswith(f.metadata["help"]) and a.help.count("default") == 1
        assert a.default == f.default
    assert actions["scheduling_policy"].choices == ["fcfs", "priority", "static"]
    args = ap.parse_args(["--max-num-seqs", "8", "--token-buckets", "16", "32",
                          "--strict-compile", "--preemption-mode", "swap"])
    cfg = from_options(EngineConfig, args)
    assert cfg == EngineConfig(max_num_seqs=8, token_buckets=(16, 32), strict_compile=True,
                               preemption_mode="swap")


def test_prefix_caching_is_on_by_default_and_the_flags_turn_it_off():
    ap = argparse.ArgumentParser()
    add_options(ap, EngineConfig)
    assert from_options(EngineConfig, ap.parse_args([])).enable_prefix_caching
    for flag in ("--no-prefix-caching", "--no-enable-prefix-caching"):
        assert not from_options(EngineConfig, ap.parse_args([flag])).enable_prefix_caching
    assert from_options(EngineConfig, ap.parse_args(["--no-prefix-caching",
                                                     "--prefix-caching"])).enable_prefix_caching
    with pytest.raises(ValueError, match="log_stats_interval_s"):
        EngineConfig(log_stats_interval_s=-1)


@pytest.mark.parametrize("max_num_seqs, mid", [(64, (12, 24, 48)), (256, (12, 24, 48, 96, 192)),
                                               (8, ()), (12, ()), (13, (12,))])
def test_default_buckets_add_the_decode_midpoints_and_keep_one_seq_bucket_per_token_bucket(
        max_num_seqs, mid):
    from jaxserve.runtime.step_inputs import pick_bucket, seq_bucket

    cfg = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=512, max_held_seqs=0)
    tokens, seqs, _ = cfg.buckets()
    pow2 = {1 << i for i in range(10)}
    decode_rows = pow2 | set(mid) | {max_num_seqs}
    assert set(tokens) == decode_rows
    assert set(seqs) == {x for x in pow2 if x < max_num_seqs} | set(mid) | {max_num_seqs}
    for n in range(1, max_num_seqs + 1):  # a decode step of n sequences pads its tokens and
        padded = pick_bucket(tokens, n, "tokens")  # its sequences to the same rows, the
        rows = min(x for x in decode_rows if x >= n)  # fewest there are
        assert padded == rows and seq_bucket(seqs, padded) == rows
    # held prefills: steps of up to max_num_seqs + max_held_seqs sequences (within the
    # budget); the decode steps' buckets stay as they were
    held = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=512)
    step = min(2 * max_num_seqs, 512)
    assert held.max_step_seqs == step and held.buckets()[0] == tokens
    assert set(held.buckets()[1]) == set(seqs) | {x for x in pow2 if x < step} | {
        x for x in (12, 24, 48, 96, 192, 384) if x < step} | {step}
    # explicit buckets are taken as given (plus the limits)
    assert EngineConfig(max_num_seqs=64, token_buckets=(16, 64)).buckets()[0] == (16, 64, 512)


def test_one_table_width_keeps_max_model_lens_blocks_alone_unless_given():
    cfg = EngineConfig(max_num_seqs=16, max_model_len=2048, block_size=16)
    assert cfg.buckets()[2] == (4, 8, 16, 32, 64, 128)
    assert cfg.buckets(one_table_width=True)[2] == (128,)
    assert cfg.buckets(one_table_width=True)[:2] == cfg.buckets()[:2]
    given = EngineConfig(max_num_seqs=16, max_model_len=2048, block_size=16,
                         block_buckets=(8, 32))
    assert given.buckets(one_table_width=True)[2] == (8, 32, 128)


def test_held_prefills_and_the_ttft_target_are_options_checked_by_name():
    ap = argparse.ArgumentParser()
    add_options(ap, EngineConfig)
    cfg = from_options(EngineConfig, ap.parse_args(["--max-held-seqs", "3",
                                                    "--ttft-target-ms", "250"]))
    sched = cfg.on_platform("cpu").scheduler_config()
    assert (sched.max_held_seqs, sched.ttft_target_s) == (3, 0.25)
    for name, bad in (("max_held_seqs", -1), ("max_held_seqs", 1.5), ("ttft_target_ms", 0)):
        with pytest.raises(ValueError, match=name):
            EngineConfig(**{name: bad})
    # off where prompts end in a handover, and under static batching
    for kw in ({"role": "prefill"}, {"role": "decode"}, {"scheduling_policy": "static"}):
        assert EngineConfig(**kw).on_platform("cpu").scheduler_config().max_held_seqs == 0
    cpu = EngineConfig().on_platform("cpu")
    assert cpu.scheduler_config().max_held_seqs == cpu.max_num_seqs


def test_speculative_config_is_vllms_spelling_of_the_flat_fields():
    flat = EngineConfig(speculative_method="ngram", num_speculative_tokens=3,
                        prompt_lookup_max=5, prompt_lookup_min=1)
    spec = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                            "prompt_lookup_max": 5, "prompt_lookup_min": 1})
    assert spec == flat and spec.speculative_config is None and hash(spec) == hash(flat)
    draft = EngineConfig(speculative_config={"model": "/some/draft"})
    assert (draft.speculative_method, draft.speculative_model) == ("draft_model", "/some/draft")
    with pytest.raises(ValueError, match="speculative_config: unknown key 'acceptance_method'"):
        EngineConfig(speculative_config={"method": "ngram", "acceptance_method": "typical"})
    with pytest.raises(ValueError, match="speculative_method must be one of"):
        EngineConfig(speculative_config={"method": "eagle"})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="speculative_config must be a dict"):
        EngineConfig(speculative_config='{"method": "ngram"}')


def test_serve_flags_take_vllms_spellings():
    from jaxserve.serving.cli import parse_args, split_config

    engine, server = split_config(parse_args([
        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4, '
                                '"prompt_lookup_max": 3, "prompt_lookup_min": 2}',
        "--gpu-memory-utilization", "0.5", "--num-gpu-blocks-override", "99",
        "--served-model-name", "mine", "--no-enable-prefix-caching", "--seed", "7"]))
    assert engine == EngineConfig(speculative_method="ngram", num_speculative_tokens=4,
                                  prompt_lookup_max=3, prompt_lookup_min=2,
                                  kv_cache_memory_fraction=0.5, num_kv_blocks=99,
                                  enable_prefix_caching=False, seed=7)
    assert server.model_name == "mine"
    flat, _ = split_config(parse_args(["--speculative-method", "ngram",
                                       "--ngram-prompt-lookup-max", "3"]))
    assert (flat.speculative_method, flat.prompt_lookup_max) == ("ngram", 3)
    with pytest.raises(SystemExit, match="unknown key 'num_lookahead_slots'"):
        split_config(parse_args(["--speculative-config", '{"num_lookahead_slots": 2}']))


def test_kv_cache_dtype_takes_vllms_fp8_spellings_and_positive_scales():
    for name in ("fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16", "auto"):
        assert EngineConfig(kv_cache_dtype=name).kv_cache_dtype == name
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of .*fp8_e4m3, fp8_e5m2"):
        EngineConfig(kv_cache_dtype="fp8_e4m3fnuz")
    ap = argparse.ArgumentParser()
    add_options(ap, EngineConfig)
    cfg = from_options(EngineConfig, ap.parse_args(["--kv-cache-dtype", "fp8", "--k-scale",
                                                    "0.5"]))
    assert (cfg.kv_cache_dtype, cfg.k_scale, cfg.v_scale) == ("fp8", 0.5, 1.0)
    for name, bad in (("k_scale", 0.0), ("v_scale", -1.0), ("k_scale", float("inf"))):
        with pytest.raises(ValueError, match=name):
            EngineConfig(**{name: bad})


@pytest.mark.parametrize("kw, field", [
    (dict(max_loras=0), "max_loras"), (dict(max_lora_rank=0), "max_lora_rank"),
    (dict(max_loras=4, max_cpu_loras=2), "max_cpu_loras"),
])
def test_lora_options_are_checked(kw, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(enable_lora=True, **kw)
