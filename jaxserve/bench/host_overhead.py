"""Host work per engine step: the real engine loop over a runner that computes nothing.

    python scripts/bench_scheduler.py [--running 64 256 1024] [--steps 200] [--async]
                                      [--device-ms 0] [--decode-steps 1 8]
                                      [--workload mixed|decode] [--tiny]

Runs LLMEngine (schedule, input build, launch, postprocess with detokenization, the outputs
to the caller) with the default model's config and tokenizer, but with ZeroCostRunner in place
of the model: a step costs no device time (or `--device-ms` per decode step, as if a device ran
it). Keeps N requests in flight (a finished one is replaced at once; of mixed prompt and output
lengths, or, with `--workload decode`, all decoding) and prints, per N, each part's median and
p99 per step, the host's time per token and the tokens/s. "step" is engine.step() plus the
requests added before it, timed in a pass of its own without the per-part timers; the parts are
timed in a second pass over the same workload. "idle" is how long the device waited for the
host before each launch: with `--async` and a device step longer than the host's work, the part
of the host's work that cannot overlap the device. With `--decode-steps` above 1 a step where every
sequence decodes runs that many decode steps in one call (EngineConfig.decode_steps).
`--tiny` times the whole engine instead, its model a tiny random Llama (bench_tiny).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import time
from collections.abc import Callable

import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.core.kv_layout import KVLayout
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine import llm_engine
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.runtime.logits_processing import LogitsShape
from jaxserve.runtime.runner import StepOutput
from jaxserve.runtime.step_inputs import StepInputs, StepPreparer

PARTS = ("add", "schedule", "build", "launch", "fetch", "postprocess", "detokenize", "outputs")


class ZeroCostRunner(StepPreparer):
    """ModelRunner's interface without a model: its steps are prepared as the runner's are,
    and a step "samples" a token that depends on the row's seed and position, at once, or
    `device_s` per decode step after the device (a queue of steps) would have started it. A
    step of several decode steps samples a token per step and row, and stops a row at its
    limit or a stop id, as runtime/decode_loop.py does. A step that verifies proposals
    (speculative decoding) accepts each row's proposals while they are the tokens it would
    sample, and costs `verify_s` more, plus `draft_s` per proposed token. `tokens`: (seeds
    (S, 1), positions (S, K)) -> the token sampled after each position (by default a hash of
    the two)."""

    def __init__(self, config: EngineConfig, vocab_size: int, num_layers: int,
                 device_s: float = 0.0, verify_s: float = 0.0, draft_s: float = 0.0,
                 tokens: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None):
        self.config = config
        self.buckets = config.buckets()
        self.block_size = config.block_size
        self.num_blocks = config.num_kv_blocks
        self.num_host_blocks = 0
        self.logits_shape = LogitsShape(vocab_size, config.max_model_len)
        self.kv_layout = KVLayout.whole(num_layers)
        self.lora_enabled = False
        self.num_compiles = 0
        # as on an accelerator, whose host loop this stands for
        self.plain_programs = config.plain_programs is not False
        self.vocab_size = vocab_size
        self.device_s, self.verify_s, self.draft_s = device_s, verify_s, draft_s
        self.tokens = tokens or (lambda seeds, pos: (pos * 7919 + seeds) % vocab_size)
        self._device_free = 0.0  # when the last launched step ends
        # per launch: how long the device sat idle before it (0 while steps queue up)
        self.idle: list[float] = []

    def dispatch(self, inp: StepInputs) -> tuple[StepOutput, float]:
        loop, spec = inp.decode, inp.spec
        k = 1 if loop is None else loop.num_steps
        seeds = inp.sampling.seeds[:, None].astype(np.int64)
        num_drafts, kk = spec.num_drafts, spec.draft_tokens.shape[1]
        # a verifying row's positions: its last token's, then each proposal's
        first = inp.logits_indices if not kk else spec.verify_rows[:, 0]
        pos = (inp.attn.positions[first].astype(np.int64)[:, None]
               + np.arange(k if not kk else kk + 1))
        tokens = self.tokens(seeds, pos).astype(np.int32)
        extra = 0.0
        if kk:  # a row keeps its proposals up to the first that is not the token it samples
            agree = (spec.draft_tokens == tokens[:, :-1]) & (np.arange(kk) < num_drafts[:, None])
            accepted = np.where(agree.all(axis=1), kk, agree.argmin(axis=1))
            counts = np.where(inp.sampling.samples, accepted + 1, 0).astype(np.int32)
            extra = self.verify_s + self.draft_s * int(num_drafts.sum())
        elif loop is None:
            counts = inp.sampling.samples.astype(np.int32)
        else:  # up to its limit, or its first stop id
            stops = (tokens[:, :, None] == loop.stop_ids[:, None, :]).any(axis=2)  # (S, K)
            first = np.where(stops.any(axis=1), stops.argmax(axis=1) + 1, k)
            counts = np.minimum(loop.limit, first).astype(np.int32)
        # the loop ends when every row has stopped; a verifying step is one step
        steps = 1 if kk else int(counts.max(initial=1))
        now = time.perf_counter()
        if self._device_free:
            self.idle.append(max(0.0, now - self._device_free))
        done = max(now, self._device_free) + self.device_s * steps + extra
        self._device_free = done
        return StepOutput(tokens, counts), done

    def fetch(self, step: tuple[StepOutput, float], want_logprobs: bool,
              want_prompt_logprobs: bool = False, want_pooled: bool = False) -> StepOutput:
        if want_pooled:
            raise ValueError("the zero-cost runner computes no hidden states to pool")
        out, done = step
        if (wait := done - time.perf_counter()) > 0:
            time.sleep(wait)
        return out

    def warmup(self) -> float:
        return 0.0

    def flush_host_copies(self) -> None:
        pass

    def keepalive(self) -> None:
        pass


MAX_LEN = 4096


def make_engine(num_running: int, loaded, async_scheduling: bool | None, device_s: float = 0.0,
                decode_steps: int = 1, full_pool: bool = False) -> LLMEngine:
    """`full_pool`: blocks for every sequence at max_model_len (else half that)."""
    cfg = EngineConfig(max_num_seqs=num_running, max_num_batched_tokens=max(2048, 2 * num_running),
                       max_model_len=MAX_LEN, block_size=16,
                       num_kv_blocks=num_running * (MAX_LEN // 16) // (1 if full_pool else 2),
                       async_scheduling=async_scheduling, decode_steps=decode_steps)
    runner = ZeroCostRunner(cfg, loaded.config.vocab_size, loaded.config.num_layers, device_s)
    return LLMEngine(cfg, loaded, runner=runner)


WORKLOADS = ("mixed", "decode")


class _Workload:
    """N requests in flight, of random ids. "mixed": lognormal prompts, 16-511 output tokens
    each, so prompt chunks keep joining the decodes; "decode": 16-63-token prompts and outputs
    longer than the run, so once they are in every step decodes alone."""

    def __init__(self, engine: LLMEngine, num_running: int, kind: str = "mixed", seed: int = 0):
        self.engine, self.num_running, self.kind = engine, num_running, kind
        self.rng = np.random.default_rng(seed)
        self.count = 0
        self.vocab = engine.model_config.vocab_size

    def top_up(self) -> None:
        e = self.engine
        while e.num_unfinished_requests < self.num_running:
            if self.kind == "decode":
                n = int(self.rng.integers(16, 64))
                out = MAX_LEN - n
            else:
                n = int(min(self.rng.lognormal(5.0, 1.0), 1500)) + 1
                out = int(self.rng.integers(16, 512))
            ids = self.rng.integers(0, self.vocab, n).tolist()
            params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=out)
            e.add_request(f"r{self.count}", prompt_token_ids=ids, params=params)
            self.count += 1

    def step(self) -> int:
        self.top_up()
        return sum(len(o.outputs[0].new_token_ids) for o in self.engine.step())

    def warm_up(self, steps: int) -> None:
        """`steps` steps; "decode": then on until every prompt is in."""
        for _ in range(steps):
            self.step()
        sched = self.engine.scheduler
        while self.kind == "decode" and (sched.waiting or any(
                s.num_computed_tokens < s.num_prompt_tokens for s in sched.running)):
            self.step()


@contextlib.contextmanager
def _timed_parts(engine: LLMEngine, spent: dict[str, float]):
    """Wrap the engine's parts so that each adds its time to spent[part]."""

    def timed(part, fn):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[part] += time.perf_counter() - t
        return wrapper

    detok_cls = llm_engine.IncrementalDetokenizer

    class TimedDetokenizer(detok_cls):
        __slots__ = ()
        add = timed("detokenize", detok_cls.add)

    for seq in engine.requests.values():  # those added before are timed too
        if seq.detok is not None:
            seq.detok.__class__ = TimedDetokenizer
    patches = [(engine.scheduler, "schedule", "schedule"),
               (engine.runner, "prepare_step", "build"), (engine.runner, "dispatch", "launch"),
               (engine.postprocessor, "launched", "launch"),
               (engine.runner, "fetch", "fetch"), (engine.postprocessor, "resolve", "postprocess"),
               (engine, "_output", "outputs"), (engine, "_grouped", "outputs")]
    for obj, name, part in patches:
        setattr(obj, name, timed(part, getattr(obj, name)))
    llm_engine.IncrementalDetokenizer = TimedDetokenizer
    try:
        yield
    finally:
        llm_engine.IncrementalDetokenizer = detok_cls
        for obj, name, _ in patches:
            delattr(obj, name)


def bench(num_running: int, steps: int, loaded, async_scheduling: bool = False,
          device_ms: float = 0.0, warm_steps: int = 20, decode_steps: int = 1,
          workload: str = "mixed") -> dict:
    """{"running", "decode_steps", "tokens_per_step", "tok_s", "us_per_token", "ideal_tok_s",
    "p50": {part: ms}, "p99": {part: ms}}. A step of several decode steps counts as one; the
    ideal is the device's own pace (a token per sequence per `device_ms`; 0: none). Besides
    the parts, "step" (the whole loop) and "idle": how long the device waited for the host
    before each launch, the host's share that did not overlap a device step of `device_ms`
    (with none, the whole loop)."""
    engine = make_engine(num_running, loaded, async_scheduling, device_ms / 1e3, decode_steps,
                         full_pool=workload == "decode")
    llm_engine.settle_heap()  # as the server does once it has started
    work = _Workload(engine, num_running, workload)
    work.warm_up(warm_steps)  # reach a steady mix of decodes and prefill chunks
    engine.runner.idle.clear()
    step_t, tokens = [], 0
    t_start = time.perf_counter()
    for _ in range(steps):
        t = time.perf_counter()
        tokens += work.step()
        step_t.append(time.perf_counter() - t)
    elapsed = time.perf_counter() - t_start
    idle = list(engine.runner.idle)
    parts: dict[str, list[float]] = collections.defaultdict(list)
    with _timed_parts(engine, spent := collections.defaultdict(float)):
        for _ in range(steps):
            spent.clear()
            t = time.perf_counter()
            work.top_up()
            spent["add"] = time.perf_counter() - t
            engine.step()
            for part in PARTS:
                parts[part].append(spent[part])
    parts["step"] = step_t
    parts["idle"] = idle or [0.0]
    ms = lambda a, q: float(np.percentile(a, q) * 1e3)
    return {"running": num_running, "decode_steps": decode_steps,
            "tokens_per_step": tokens / steps, "tok_s": tokens / elapsed,
            "us_per_token": elapsed / max(tokens, 1) * 1e6,
            "ideal_tok_s": num_running / (device_ms / 1e3) if device_ms else 0.0,
            "p50": {k: ms(v, 50) for k, v in parts.items()},
            "p99": {k: ms(v, 99) for k, v in parts.items()}}


def bench_tiny(num_requests: int = 256, max_tokens: int = 64, async_scheduling: bool = False,
               decode_steps: int = 1, warm_runs: int = 2, tokenizer=None) -> dict:
    """The whole engine, model included, where the model costs little: LLM.generate on the
    tiny random Llama (jaxserve/testing/tiny.py) with the default model's tokenizer,
    `num_requests` prompts of 16-63 random tokens, greedy, `max_tokens` each (ignore_eos), at
    max_num_seqs = num_requests. `warm_runs` untimed, then one timed: {"ms_per_step",
    "tok_s", "steps"}. `tokenizer`: the default model's, if loaded already."""
    import tempfile

    from jaxserve.engine.llm import LLM
    from jaxserve.models.loader import load_model
    from jaxserve.testing.tiny import write_tiny_llama

    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 512, int(n)).tolist() for n in rng.integers(16, 64, num_requests)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    with tempfile.TemporaryDirectory() as d:
        write_tiny_llama(d, 512)
        (tokenizer or load_model().tokenizer).save_pretrained(d)
        llm = LLM(model=d, max_num_seqs=num_requests, max_model_len=256,
                  async_scheduling=async_scheduling, decode_steps=decode_steps)
    for _ in range(warm_runs):
        llm.generate(prompts, params, use_tqdm=False)
    steps = llm.engine.metrics.num_steps
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    steps = llm.engine.metrics.num_steps - steps
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"ms_per_step": elapsed / steps * 1e3, "tok_s": tokens / elapsed, "steps": steps}


def format_table(results: list[dict]) -> str:
    head = f"{'ms per step':<12}" + "".join(f"{r['running']:>9} p50 {'p99':>7}"
                                             for r in results)
    lines = [head]
    for part in (*PARTS, "step", "idle"):
        lines.append(f"{part:<12}" + "".join(f"{r['p50'][part]:>13.3f} {r['p99'][part]:>7.3f}"
                                             for r in results))
    lines.append(f"{'tokens/step':<12}" + "".join(f"{r['tokens_per_step']:>21.1f}"
                                                  for r in results))
    lines.append(f"{'us/token':<12}" + "".join(f"{r['us_per_token']:>21.2f}" for r in results))
    lines.append(f"{'tok/s':<12}" + "".join(f"{r['tok_s']:>21.0f}" for r in results))
    if any(r["ideal_tok_s"] for r in results):
        lines.append(f"{'ideal tok/s':<12}" + "".join(f"{r['ideal_tok_s']:>21.0f}"
                                                      for r in results))
    return "\n".join(lines)


def main() -> None:
    from jaxserve.models.loader import load_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--running", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--async", dest="async_scheduling", action="store_true",
                    help="asynchronous scheduling (step N+1 launched before N's tokens are read)")
    ap.add_argument("--device-ms", type=float, default=0.0,
                    help="device time of each decode step (the runner sleeps it out at fetch); "
                         "the ideal tokens/s is then a token per sequence per decode step")
    ap.add_argument("--decode-steps", type=int, nargs="+", default=[1],
                    help="the engine's decode_steps (several: a table for each)")
    ap.add_argument("--workload", choices=WORKLOADS, default="mixed",
                    help="mixed: prompt chunks keep joining the decodes; decode: every step "
                         "decodes alone, once the prompts are in")
    ap.add_argument("--tiny", action="store_true",
                    help="instead: the real engine and model on a tiny random Llama, 256 "
                         "requests x 64 greedy tokens (LLM.generate), ms per step and tok/s")
    args = ap.parse_args()
    if args.tiny:
        for k in args.decode_steps:
            r = bench_tiny(async_scheduling=args.async_scheduling, decode_steps=k)
            print(f"tiny model, decode_steps {k}: {r['ms_per_step']:.3f} ms per step "
                  f"({r['steps']} steps), {r['tok_s']:.0f} tok/s")
        return
    loaded = load_model()  # only its config and tokenizer are used
    for k in args.decode_steps:
        results = [bench(n, args.steps, loaded, args.async_scheduling, args.device_ms,
                         decode_steps=k, workload=args.workload) for n in args.running]
        print(f"decode_steps {k}, {args.workload} workload")
        print(format_table(results))
