"""EngineConfig: one validated, frozen set of engine arguments (imports no jax).

Every field carries its one description (`option(default, help)`); the command lines of
`scripts/serve.py` and `scripts/bench.py` are derived from the fields with `add_options`, so a
flag, its default and its help line cannot drift from the dataclass.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import types
import typing
from typing import Any

from jaxserve.core.policies import POLICIES, policy_class
from jaxserve.core.scheduler import PreemptionMode, SchedulerConfig
from jaxserve.kernels.attention.base import AttentionBackend


def option(default: Any, help: str, aliases: tuple[str, ...] = (), choices=None) -> Any:
    """A dataclass field with its command-line help (and further flag names; a bool's
    `--x` alias brings `--no-x` with it; `choices`: the names a string may take, read when
    the options are made, so a table registered into later is seen)."""
    return dataclasses.field(default=default, metadata={"help": help, "aliases": aliases,
                                                        "choices": choices})


def _pow2_range(lo: int, hi: int, factor: int = 2) -> tuple[int, ...]:
    out, x = [], lo
    while x < hi:
        out.append(x)
        x *= factor
    out.append(hi)
    return tuple(sorted(set(out)))


def _midpoints(hi: int) -> tuple[int, ...]:
    """1.5x each power of two from 8 while below hi (12, 24, 48 for 64): the sizes between the
    powers of two where decode steps run, so a step of 33 sequences pads to 48, not 64."""
    return tuple(x for x in _pow2_range(12, hi) if x < hi)  # _pow2_range ends at hi itself


DTYPES = ("auto", "float32", "bfloat16", "float16")
# kv_cache_dtype's further spellings (vLLM's): 8-bit float pools, stored scaled by k/v_scale
FP8_KV_DTYPES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
KV_CACHE_DTYPES = DTYPES + tuple(FP8_KV_DTYPES)
MAX_NUM_SEQS = 64  # max_num_seqs's default on an accelerator
CPU_MAX_NUM_SEQS = 16  # ... and on a CPU (see the field's help)
DECODE_STEPS = 8  # decode_steps's default on an accelerator
CPU_DECODE_STEPS = 1  # ... and on a CPU (see the field's help)
MAX_DECODE_STEPS = 64
SPECULATIVE_METHODS = (None, "ngram", "draft_model")
POOLINGS = ("mean", "last")
# vLLM's speculative_config keys -> the flat fields they set
SPECULATIVE_CONFIG_KEYS = {"method": "speculative_method", "model": "speculative_model",
                           "num_speculative_tokens": "num_speculative_tokens",
                           "prompt_lookup_max": "prompt_lookup_max",
                           "prompt_lookup_min": "prompt_lookup_min"}


class LayerLoop(enum.StrEnum):
    SCAN = "scan"  # one layer body run L times: small program; weights read at its index
    UNROLL = "unroll"  # L layer bodies reading their weights in place: faster, slower to compile


class Role(enum.StrEnum):
    BOTH = "both"  # prefill and decode in this engine (colocated)
    PREFILL = "prefill"  # prompts and first tokens; K/V handed over (engine/handover.py)
    DECODE = "decode"  # takes over prefilled requests and decodes them


class Quantization(enum.StrEnum):
    AUTO = "auto"  # quantized projections stay so (kernels/quant.py, kernels/fp8.py)
    NONE = "none"  # every weight expanded to the float dtype at load


@dataclasses.dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str | None = option(
        None, "HF model directory or .gguf file (default: the bundled SmolLM2-135M-Instruct)")
    dtype: str = option("auto", f"weights and KV dtype, one of {', '.join(DTYPES)} "
                                "(auto: bfloat16 on a GPU/TPU, float32 on a CPU)")
    kv_cache_dtype: str = option(
        "auto", f"KV pool dtype, one of {', '.join(KV_CACHE_DTYPES)} (auto: float16 under a "
                "float32 model on the cpu attention backend, else the dtype's): a half-"
                "precision pool halves what attention reads and holds twice the tokens (cpu "
                "and jnp backends); fp8 (= fp8_e4m3) and fp8_e5m2 quarter a float32 pool's "
                "bytes (every backend), K/V stored divided by k_scale/v_scale and saturated")
    k_scale: float = option(
        1.0, "fp8 KV pools: K is stored as K / k_scale and read back times k_scale (vLLM's "
             "k_scale, one for every layer; a checkpoint's per-layer scales are not read)")
    v_scale: float = option(1.0, "fp8 KV pools: as k_scale, for V")
    max_model_len: int = option(2048, "longest sequence (prompt + output) a request may reach")
    max_num_seqs: int | None = option(
        None, "most sequences in one step (default: 16 on a CPU, 64 elsewhere; at most "
              "max_num_batched_tokens): a CPU's decode step is compute-bound at a few rows, "
              "so more sequences there each run slower for no more throughput")
    max_num_batched_tokens: int = option(512, "token budget of one step (prefill + decode)")
    max_held_seqs: int | None = option(
        None, "with max_num_seqs sequences decoding and token budget to spare, up to this "
              "many more requests get their prompt computed and their first token sent, "
              "then hold their KV blocks until a decode slot frees; they are preempted "
              "before any running sequence (default: max_num_seqs; 0: off)")
    ttft_target_ms: float | None = option(
        None, "a request that has waited this long for its first token gets its prefill in "
              "the next step, ahead of other prompts (default: off)")
    block_size: int = option(16, "tokens per KV block")
    num_kv_blocks: int | None = option(
        None, "KV blocks in the device pool, each a block of every layer's K and V "
              "(default: sized from the memory settings)",
        aliases=("--num-gpu-blocks-override",))
    kv_cache_memory_bytes: int = option(1 << 30, "bytes for the KV pool when num_kv_blocks is "
                                                 "not given and no memory fraction applies")
    kv_cache_memory_fraction: float | None = option(
        None, "fraction of accelerator memory for params + KV pool; needs device memory "
              "statistics (GPUs report them), elsewhere kv_cache_memory_bytes applies",
        aliases=("--gpu-memory-utilization",))
    token_buckets: tuple[int, ...] | None = option(
        None, "padded token counts to compile (default: powers of two up to the budget, plus "
              "the sizes between them below max_num_seqs and max_num_seqs itself, where decode "
              "steps run): a step costs its bucket's size, so close buckets waste less")
    seq_buckets: tuple[int, ...] | None = option(
        None, "padded sequence counts; a step of T padded tokens pads its sequences to the "
              "smallest of these >= min(T, max_num_seqs), so each token bucket has one "
              "(default: the token buckets' sizes up to max_num_seqs)")
    block_buckets: tuple[int, ...] | None = option(
        None, "padded blocks-per-sequence widths to compile (default: powers of two from 4 "
              "up to the blocks of max_model_len; that last alone for an attention backend "
              "whose cost does not grow with the width, the cpu kernel's)")
    tensor_parallel_size: int = option(
        1, "devices each step's model is split over (Megatron layout on a mesh axis 'model': "
           "heads, MLP columns/rows and vocabulary; the KV pool by kv head)")
    expert_parallel_size: int = option(
        1, "devices a mixture-of-experts model's experts are split over (a mesh axis 'expert' "
           "beside tensor parallelism's: expert_parallel_size x tensor_parallel_size devices "
           "in all); tokens are not exchanged, each device runs its experts' share of them")
    data_parallel_size: int = option(
        1, "independent engine replicas, each on its own group of tensor_parallel_size "
           "devices, behind one front; a router sends each request to the replica holding "
           "its prompt's prefix, else to the least-loaded one")
    role: Role = option(
        Role.BOTH, "disaggregated serving: 'prefill' computes prompts and first tokens and "
                   "keeps each request's KV blocks until a decode engine takes them over; "
                   "'decode' takes over prefilled requests and decodes them; 'both' does all")
    handover_host: str = option(
        "127.0.0.1", "address a prefill engine's K/V transfer server listens on (decode "
                     "engines on other machines pull from it)")
    strict_compile: bool = option(False, "raise if any program compiles after warmup()")
    decode_steps: int | None = option(
        None, "most decode steps one call of the step program runs when every running "
              "sequence decodes and none waits: the host schedules, builds and postprocesses "
              "once per call, and streams up to that many tokens per sequence at a time "
              "(default: 8 on an accelerator; 1, off, on a CPU, where the host's work per "
              "step is small beside the model's); 1 under speculative decoding")
    async_scheduling: bool | None = option(
        None, "launch step N+1 before step N's tokens are read back, so the host's work "
              "hides under the device's step; same tokens either way (default: chosen step "
              "by step from the time steps take in each mode at each load, starting on with "
              "an accelerator and off on a CPU, where host and device share the cores)")
    plain_programs: bool | None = option(
        None, "a second program per bucket for steps whose rows are all greedy or sample "
              "from the temperature alone, with no logprobs or logit processing: it has no "
              "runtime branches, each of which a GPU resolves by waiting for the device "
              "(default: on with an accelerator, off on a CPU, where branches cost nothing)")
    compilation_cache_dir: str | None = option(
        None, "persistent XLA compilation cache, so a second start loads its programs "
              "(default: $JAXSERVE_CACHE_DIR/xla or ~/.cache/jaxserve/xla; '' turns it off)")
    layer_loop: LayerLoop | None = option(
        None, "how the step runs the layers: scan (one layer body: small programs, quick to "
              "compile and load) or unroll (a body per layer reading its weights in place: "
              "faster steps, slower to compile and load; on a GPU the whole step is then one "
              "CUDA graph, where a scanned loop is launched a kernel at a time and waits for "
              "the device at every layer) (default: unroll on an accelerator, scan on a CPU)")
    quantization: Quantization = option(
        Quantization.AUTO, "auto: a GGUF's Q8_0, Q4_0 and Q4_1 layer projections stay in "
                           "their blocks, and an HF checkpoint's FP8 ones FP8 (off a CPU), so "
                           "steps stream fewer bytes, and are dequantized inside the step; "
                           "none: expand them at load")
    attention_backend: AttentionBackend = option(
        AttentionBackend.AUTO, "paged attention kernel (auto: on a GPU the fastest of "
                               "mosaic, triton, pallas and xla that passes a self-test on the "
                               "device, cached per device, JAX version, shapes and dtype, "
                               "with a warning for each passed over; on a CPU cpu where it "
                               "builds, else xla)")
    max_logprobs: int = option(20, "most top logprobs a request may ask for")
    seed: int = option(0, "engine seed for requests that bring none")
    enable_step_trace: bool = option(
        False, "record every step's requests, prefill/decode tokens and duration")
    scheduling_policy: str = option(
        "fcfs", "fcfs (arrival order), priority (smaller first, optional aging), static (a "
                "baseline: batches run to completion) or another policy registered in "
                "jaxserve.core.policies.POLICIES", choices=POLICIES)
    priority_aging_s: float | None = option(
        None, "with priority: every this many seconds since arrival is worth one level")
    preemption_mode: PreemptionMode = option(
        PreemptionMode.RECOMPUTE, "what preemption does: recompute (free the blocks, prefill "
                                  "again) or swap (copy to the host pool and back)")
    swap_space_bytes: int = option(256 << 20, "host pool for swap preemption and the prefix "
                                              "cache's host tier, in bytes")
    free_window_blocks: bool | None = option(
        None, "models with sliding-window layers: a sequence's blocks leave those layers' "
              "part of the pool once no query sees them, the pool laid out in groups of "
              "layers with a block table each (default: on where the model has windows, "
              "off where a draft model, swap preemption or a prefill/decode role needs "
              "whole tables; on is then refused)")
    enable_prefix_caching: bool = option(
        True, "reuse the K/V of prompt prefixes already computed (hash-chained full blocks; "
              "cached blocks evicted from the device pool spill to the host pool and come "
              "back from there)", aliases=("--prefix-caching",))
    log_stats_interval_s: float = option(
        5.0, "while requests run, log a line of serving figures this often (throughput, "
             "queues, KV usage, prefix cache hit rate); 0 turns it off")
    prefill_chunk_alignment: int = option(
        1, "cut prompt chunks to multiples of this (not the last chunk)")
    max_waiting_requests: int | None = option(
        None, "refuse requests when this many wait (default: unbounded)")
    speculative_method: str | None = option(
        None, "speculative decoding: 'ngram' proposes what followed the latest earlier "
              "occurrence of the context's last tokens (prompt lookup); 'draft_model' runs "
              "speculative_model, a smaller model with the same tokenizer, to propose. "
              "Proposals are verified in the target's own step; greedy and sampled outputs "
              "keep the target's distribution (default: off)")
    speculative_model: str | None = option(
        None, "draft_model: the draft model, a path as for model (a Llama-family model with "
              "the target's vocabulary; it gets its own KV pool with the target's blocks)")
    num_speculative_tokens: int = option(4, "most tokens proposed per sequence and step")
    prompt_lookup_min: int = option(2, "ngram: shortest suffix matched",
                                    aliases=("--ngram-prompt-lookup-min",))
    prompt_lookup_max: int = option(4, "ngram: longest suffix matched (tried first)",
                                    aliases=("--ngram-prompt-lookup-max",))
    speculative_adaptive: bool = option(
        True, "choose each step's number of proposed tokens (0 included) from the batch, the "
              "token budget, the acceptance rate and the step times seen so far, so "
              "speculation stops where the batch is compute-bound; off: always the most")
    pooling: str = option(
        "mean", "how /v1/embeddings and LLM.embed pool an input's final hidden states: mean "
                "(over every token; such a request reads no blocks from the prefix cache, "
                "whose tokens' hidden states are not kept) or last (the last token's, which "
                "is computed even when the rest comes from the cache)")
    enable_lora: bool = option(
        False, "serve LoRA adapters (PEFT's format) beside the base model: a request names "
               "its adapter (LoRARequest) and rows of different adapters share a step")
    max_loras: int = option(
        1, "LoRA adapters one step may use: the device holds this many slots of adapter "
           "weights; a request whose adapter finds no slot free waits for one")
    max_lora_rank: int = option(
        16, "largest LoRA rank served: every slot is padded to it, and an adapter of a "
            "higher rank is refused")
    max_cpu_loras: int | None = option(
        None, "LoRA adapters kept loaded on the host, least recently used dropped first "
              "(read again from their path when needed; default: max_loras)")
    speculative_config: dict | None = option(
        None, "vLLM's spelling of the speculative fields, as a JSON object: method, model, "
              "num_speculative_tokens, prompt_lookup_max, prompt_lookup_min (a model without "
              "a method means draft_model); its keys override the flat options, and it reads "
              "None once applied (default: none)")

    def __post_init__(self):
        if self.speculative_config is not None:
            self._apply_speculative_config(self.speculative_config)
        for name, kind in (("attention_backend", AttentionBackend), ("layer_loop", LayerLoop),
                           ("quantization", Quantization),
                           ("preemption_mode", PreemptionMode), ("role", Role)):
            value = getattr(self, name)
            if value is None and name == "layer_loop":
                continue  # resolved per platform: on_platform()
            try:
                object.__setattr__(self, name, kind(value))
            except ValueError:
                raise ValueError(f"{name} must be one of {', '.join(k.value for k in kind)}, "
                                 f"got {value!r}") from None
        policy_class(self.scheduling_policy)
        positive = ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size",
                    "kv_cache_memory_bytes", "tensor_parallel_size", "expert_parallel_size",
                    "data_parallel_size")
        for name in positive:
            v = getattr(self, name)
            if name == "max_num_seqs" and v is None:
                continue  # resolved per platform: on_platform()
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.kv_cache_memory_fraction is not None and not 0 < self.kv_cache_memory_fraction < 1:
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 1), "
                             f"got {self.kv_cache_memory_fraction}")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")
        for name, allowed in (("dtype", DTYPES), ("kv_cache_dtype", KV_CACHE_DTYPES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, "
                                 f"got {getattr(self, name)!r}")
        for name in ("k_scale", "v_scale"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not 0 < v < float("inf"):
                raise ValueError(f"{name} must be a positive finite float, got {v!r}")
        if self.max_num_seqs is not None and self.max_num_seqs > self.max_num_batched_tokens:
            raise ValueError(
                f"max_num_seqs ({self.max_num_seqs}) must be <= max_num_batched_tokens "
                f"({self.max_num_batched_tokens}): every running sequence needs a token slot")
        if self.decode_steps is not None and (not isinstance(self.decode_steps, int) or not (
                1 <= self.decode_steps <= MAX_DECODE_STEPS)):
            raise ValueError(f"decode_steps must be an int in [1, {MAX_DECODE_STEPS}], "
                             f"got {self.decode_steps!r}")
        if self.max_held_seqs is not None and (not isinstance(self.max_held_seqs, int)
                                               or self.max_held_seqs < 0):
            raise ValueError(f"max_held_seqs must be an int >= 0, got {self.max_held_seqs!r}")
        if self.ttft_target_ms is not None and not self.ttft_target_ms > 0:
            raise ValueError(f"ttft_target_ms must be positive, got {self.ttft_target_ms}")
        if self.priority_aging_s is not None and self.priority_aging_s <= 0:
            raise ValueError(f"priority_aging_s must be positive, got {self.priority_aging_s}")
        if self.prefill_chunk_alignment < 1:
            raise ValueError(f"prefill_chunk_alignment must be >= 1, "
                             f"got {self.prefill_chunk_alignment}")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0, got {self.max_waiting_requests}")
        if self.log_stats_interval_s < 0:
            raise ValueError(f"log_stats_interval_s must be >= 0, got {self.log_stats_interval_s}")
        if self.swap_space_bytes < 0:
            raise ValueError(f"swap_space_bytes must be >= 0, got {self.swap_space_bytes}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, "
                             f"got {self.pooling!r}")
        if self.speculative_method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_method must be one of "
                             f"{', '.join(map(str, SPECULATIVE_METHODS))}, "
                             f"got {self.speculative_method!r}")
        if (self.speculative_method == "draft_model") != (self.speculative_model is not None):
            raise ValueError("speculative_model is the draft model of "
                             "speculative_method='draft_model': give both or neither (got "
                             f"method {self.speculative_method!r}, model "
                             f"{self.speculative_model!r})")
        if not isinstance(self.num_speculative_tokens, int) or not (
                1 <= self.num_speculative_tokens <= 16):
            raise ValueError(f"num_speculative_tokens must be in [1, 16], "
                             f"got {self.num_speculative_tokens!r}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) and "
                             f"prompt_lookup_max ({self.prompt_lookup_max}) must satisfy "
                             f"1 <= min <= max")
        for name in ("max_loras", "max_lora_rank"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.max_cpu_loras is not None and (
                isinstance(self.max_cpu_loras, bool) or not isinstance(self.max_cpu_loras, int)
                or self.max_cpu_loras < self.max_loras):
            raise ValueError(f"max_cpu_loras must be an int >= max_loras ({self.max_loras}), "
                             f"got {self.max_cpu_loras!r}")
        for name in ("token_buckets", "seq_buckets", "block_buckets"):
            b = getattr(self, name)
            if b is not None and (not b or any(x <= 0 for x in b)):
                raise ValueError(f"{name} must be a non-empty list of positive ints, got {b!r}")
            if b is not None:
                object.__setattr__(self, name, tuple(b))

    def on_platform(self, platform: str) -> EngineConfig:
        """This config with its per-platform defaults filled in (`platform`: a jax device's,
        e.g. "cpu", "gpu"); the engine runs on what this returns."""
        cpu, fill = platform == "cpu", {}
        if self.max_num_seqs is None:
            fill["max_num_seqs"] = min(CPU_MAX_NUM_SEQS if cpu else MAX_NUM_SEQS,
                                       self.max_num_batched_tokens)
        if self.decode_steps is None:
            fill["decode_steps"] = CPU_DECODE_STEPS if cpu else DECODE_STEPS
        if self.plain_programs is None:
            fill["plain_programs"] = not cpu
        if self.layer_loop is None:
            fill["layer_loop"] = LayerLoop.SCAN if cpu else LayerLoop.UNROLL
        return dataclasses.replace(self, **fill) if fill else self

    def _resolved(self, name: str = "max_num_seqs") -> None:
        if getattr(self, name) is None:
            raise ValueError(f"{name} depends on the platform: take on_platform() first")

    def _apply_speculative_config(self, spec: Any) -> None:
        if not isinstance(spec, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(spec).__name__}")
        for key in spec:
            if key not in SPECULATIVE_CONFIG_KEYS:
                raise ValueError(f"speculative_config: unknown key {key!r}; known: "
                                 f"{', '.join(SPECULATIVE_CONFIG_KEYS)}")
        if spec.get("model") is not None and "method" not in spec:
            spec = spec | {"method": "draft_model"}
        for key, value in spec.items():
            object.__setattr__(self, SPECULATIVE_CONFIG_KEYS[key], value)
        object.__setattr__(self, "speculative_config", None)

    @property
    def scan_layers(self) -> bool:
        """Whether the step scans one layer body (layer_loop scan) rather than unrolling."""
        self._resolved("layer_loop")
        return self.layer_loop is LayerLoop.SCAN

    @property
    def spec_tokens(self) -> int:
        """K: the proposed tokens a step's rows have room for (0 without speculation)."""
        return self.num_speculative_tokens if self.speculative_method else 0

    @property
    def decode_loop_steps(self) -> int:
        """The decode steps a step runs when every sequence decodes (1 under speculative
        decoding, whose steps verify proposals instead)."""
        self._resolved("decode_steps")
        return 1 if self.speculative_method else self.decode_steps

    @property
    def held_seqs(self) -> int:
        """Held prefills (max_held_seqs) as this engine runs them: none in a prefill or
        decode engine, whose prompts end in a handover, or under static batching."""
        self._resolved()
        if self.role is not Role.BOTH or not policy_class(self.scheduling_policy).holds_prefills:
            return 0
        return self.max_num_seqs if self.max_held_seqs is None else self.max_held_seqs

    @property
    def max_step_seqs(self) -> int:
        """The most sequences one step holds: the decode slots and the held prefills."""
        return min(self.max_num_seqs + self.held_seqs, self.max_num_batched_tokens)

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)

    def scheduler_config(self, token_buckets: tuple[int, ...] = ()) -> SchedulerConfig:
        """`token_buckets`: the compiled token counts steps may end on (SchedulerConfig)."""
        self._resolved()
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len, policy=self.scheduling_policy,
            priority_aging_s=self.priority_aging_s,
            prefill_chunk_alignment=self.prefill_chunk_alignment,
            preemption_mode=self.preemption_mode,
            token_buckets=token_buckets, decode_steps=self.decode_loop_steps,
            decode_steps_plain=bool(self.plain_programs), max_held_seqs=self.held_seqs,
            ttft_target_s=None if self.ttft_target_ms is None else self.ttft_target_ms / 1e3)

    def buckets(self, one_table_width: bool = False
                ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """(token, sequence, blocks-per-sequence) buckets; each ends at its limit.
        `one_table_width`: the attention's cost does not grow with the block table's width,
        so the default blocks buckets are max_model_len's alone."""
        self._resolved()
        # Decode steps dominate a serving run and cost their padded row count: the sizes
        # between the powers of two pad them less, for a few more programs compiled once.
        mid = _midpoints(self.max_num_seqs)
        # A step in which every running sequence decodes is the commonest step of a loaded
        # server: its token count gets a bucket of its own (docs/performance.md has figures).
        tokens = self.token_buckets or (_pow2_range(1, self.max_num_batched_tokens) + mid
                                        + (self.max_num_seqs,))
        seqs = self.seq_buckets or (_pow2_range(1, self.max_step_seqs)
                                    + _midpoints(self.max_step_seqs) + mid)
        blocks = self.block_buckets or (() if one_table_width else _pow2_range(
            min(4, self.max_blocks_per_seq), self.max_blocks_per_seq))
        tokens = tuple(sorted(set(tokens) | {self.max_num_batched_tokens}))
        seqs = tuple(sorted(set(seqs) | {self.max_num_seqs, self.max_step_seqs}))
        blocks = tuple(sorted(set(blocks) | {self.max_blocks_per_seq}))
        return tokens, seqs, blocks


# ------------------------------------------------------------------------------ command lines


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def add_options(group, cls, skip: tuple[str, ...] = ()) -> None:
    """One command-line option per field of dataclass `cls`, with its type, default and help."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        hint = hints[f.name]
        args = [a for a in typing.get_args(hint) if a is not type(None)] if isinstance(
            hint, types.UnionType) else [hint]
        base = args[0]
        text = f.metadata.get("help", "")
        if "default" not in text:  # a description may say what the default means instead
            text += f" (default: {getattr(f.default, 'value', f.default)})"
        kw: dict[str, Any] = {"default": f.default, "help": text}
        if base is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif base is dict:
            kw["type"] = _json_object
        elif typing.get_origin(base) is tuple:
            kw |= {"type": typing.get_args(base)[0], "nargs": "+"}
        elif isinstance(base, type) and issubclass(base, enum.Enum):
            kw |= {"type": str, "choices": [e.value for e in base]}
        else:
            kw["type"] = base
        if f.metadata.get("choices") is not None:
            kw["choices"] = list(f.metadata["choices"])
        group.add_argument(_flag(f.name), *f.metadata.get("aliases", ()), **kw)


def from_options(cls, args: argparse.Namespace, **overrides):
    """Build dataclass `cls` from the options `add_options` added (fields not there keep their
    defaults)."""
    given = vars(args)
    kw = {f.name: given[f.name] for f in dataclasses.fields(cls) if f.name in given}
    return cls(**(kw | overrides))
