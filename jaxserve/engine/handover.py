"""The engine's side of disaggregated serving: a request's hand-over from a prefill engine to a
decode engine (EngineConfig.role).

Prefill side: a request whose first token is sampled (and that did not stop there) leaves the
running set but keeps its blocks: it is parked. `offer` gathers the blocks a decode engine asked
for and offers them for one pull (runtime/kv_transfer.py); `release` ends the request and frees
its blocks once the pull is done.

Decode side: `reserve` builds the request with its first token and takes its blocks at once,
the full prompt blocks this pool already holds by name from the prefix cache (they are not
sent again) and fresh ones for the rest, or raises NoRoom, so the front can wait or go
elsewhere. `install` scatters the pulled K/V into the fresh blocks, names the full ones in the
prefix cache and puts the request in the running set, where it decodes as if prefilled here.

An abort, a failure or a release ends a held request through the engine, which calls `forget`.
"""

from __future__ import annotations

import dataclasses
import time

from jaxserve.core.lora import LoRARequest
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.sequence import Sequence, SequenceStatus
from jaxserve.engine.postprocess import SeqUpdate
from jaxserve.runtime.kv_transfer import KVTransfer


class NoRoom(RuntimeError):
    """The decode engine cannot take the request now (blocks or sequence slots)."""


@dataclasses.dataclass(slots=True)
class HandoverStats:
    num_offered: int = 0  # prefill: offers made
    num_installed: int = 0  # decode: requests taken over
    bytes_received: int = 0  # decode: K/V bytes pulled
    seconds: float = 0.0  # decode: time spent pulling
    blocks_pulled: int = 0
    blocks_cached: int = 0  # decode: prompt blocks found here (device or host tier), not sent
    num_refused: int = 0  # decode: reservations refused for want of room
    last_bytes: int = 0
    last_seconds: float = 0.0


@dataclasses.dataclass(slots=True)
class Reservation:
    seq: Sequence
    first_block: int  # index in its block table of the first block to pull
    num_blocks: int  # blocks to pull from there on


class Handover:
    def __init__(self, engine, transfer_host: str = "127.0.0.1"):
        self.engine = engine
        self.transfer = KVTransfer(engine.runner.devices, engine.runner.head_layout,
                                   transfer_host)
        self.parked: dict[str, Sequence] = {}
        self.receiving: dict[str, Reservation] = {}
        self.stats = HandoverStats()

    @property
    def address(self) -> str:
        return self.transfer.address

    @property
    def num_held(self) -> int:
        return len(self.parked) + len(self.receiving)

    def forget(self, request_id: str) -> None:
        self.parked.pop(request_id, None)
        self.receiving.pop(request_id, None)
        self.engine.scheduler.arriving.pop(request_id, None)

    # ------------------------------------------------------------------------- prefill side

    def park(self, seq: Sequence) -> None:
        self.engine.scheduler.running.remove(seq)
        self.parked[seq.request_id] = seq

    def offer(self, request_id: str, first_block: int, num_blocks: int, uuid: int,
              timeout_s: float) -> int:
        """Offer blocks [first_block, first_block + num_blocks) of a parked request for one
        pull; returns the bytes offered. Raises KeyError if it is not parked here."""
        seq = self._held(self.parked, request_id)
        table = seq.block_table
        if not 0 <= first_block <= first_block + num_blocks <= len(table):
            raise ValueError(f"blocks [{first_block}, {first_block + num_blocks}) outside the "
                             f"request's {len(table)} blocks")
        self.stats.num_offered += 1
        if not num_blocks:
            return 0
        ids = table[first_block:first_block + num_blocks]
        return self.transfer.offer(self.engine.runner.pools, ids, uuid, timeout_s)

    def release(self, request_id: str) -> bool:
        """The pull is done: end the parked request and free its blocks."""
        if request_id not in self.parked:
            return False
        return self.engine._end(request_id, "handover")

    # -------------------------------------------------------------------------- decode side

    def reserve(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                first_token: int, first_logprob: dict | None = None, priority: int = 0,
                cache_salt: str | None = None,
                lora_request: LoRARequest | None = None) -> Reservation:
        """Take the request over with its first token and reserve its prompt's blocks. Raises
        ValueError for a bad field, NoRoom when the pool or the sequence slots are short.
        `lora_request`: the adapter it runs under, read here the first time one names it."""
        e = self.engine
        if params.n != 1:
            raise ValueError(f"n: a decode engine takes one sample per request, got {params.n}")
        e._check_vocab("first_token", [first_token])
        seq = e._add_request(request_id, None, params, prompt_token_ids, priority,
                             time.perf_counter(), cache_salt, admit=False,
                             lora_request=lora_request)[0]
        bm, num_prompt = e.block_manager, len(seq.prompt_token_ids)
        update = SeqUpdate(seq, [], "", False)
        e.postprocessor._append(seq, int(first_token), time.perf_counter(), first_logprob,
                                update)
        if update.finished:  # it stops at its first token here too: report it as done
            e.requests.pop(request_id, None)
            e.metrics.record_finished(seq)
            e._pending_outputs.append(e._output(update))
            return Reservation(seq, 0, 0)
        cached = bm.match_prefix(seq)
        loaded = e.scheduler.match_host(seq, len(cached))  # copied in, not pulled
        need = bm.blocks_needed(num_prompt)
        short = (bm.num_blocks_taken_from_free(cached) + need - len(cached)
                 > bm.num_free_blocks)
        busy = len(e.scheduler.running) + len(self.receiving) >= e.config.max_num_seqs
        out = None if short or busy else e.scheduler.take_over(seq, cached, loaded)
        if out is None:
            e.requests.pop(request_id, None)
            e._prompts.pop(request_id, None)
            self.stats.num_refused += 1
            what = (f"{need - len(cached)} free KV blocks" if short
                    else f"a sequence slot (max_num_seqs={e.config.max_num_seqs})" if busy
                    else f"a LoRA slot (max_loras={e.config.max_loras})")
            raise NoRoom(f"the decode engine has no room now: needs {what}")
        e.run_copies(out.copies)
        if out.lora_loads:  # read by _add_request just now: held on the host
            e._load_loras(out)
        e.scheduler.arriving[request_id] = seq
        have = len(cached) + len(loaded)
        r = self.receiving[request_id] = Reservation(seq, have, need - have)
        self.stats.blocks_cached += have
        return r

    def pull(self, address: str, uuid: int, num_blocks: int, timeout_s: float):
        """Pull offered blocks (off the engine thread; the pools' shapes do not change)."""
        try:
            return self.transfer.pull(address, uuid, self.engine.runner.pools, num_blocks,
                                      timeout_s)
        except Exception:
            self.transfer.drop(address)
            raise

    def install(self, request_id: str, arrays, nbytes: int, seconds: float) -> bool:
        """Scatter the pulled K/V into the reserved blocks and start decoding; False if the
        request ended meanwhile (its blocks went back then)."""
        r = self.receiving.pop(request_id, None)
        self.engine.scheduler.arriving.pop(request_id, None)
        if r is None:
            return False
        e, seq = self.engine, r.seq
        if r.num_blocks:
            ids = seq.block_table[r.first_block:r.first_block + r.num_blocks]
            e.runner.pools = self.transfer.install(e.runner.pools, ids, arrays)
        seq.num_computed_tokens = seq.num_prompt_tokens
        e.block_manager.commit(seq)  # its full prompt blocks join this prefix cache
        seq.status = SequenceStatus.RUNNING
        seq.metrics.first_scheduled_time = time.perf_counter()
        e.scheduler.running.append(seq)
        st = self.stats
        st.num_installed += 1
        st.blocks_pulled += r.num_blocks
        st.bytes_received += nbytes
        st.seconds += seconds
        st.last_bytes, st.last_seconds = nbytes, seconds
        return True

    @staticmethod
    def _held(held: dict, request_id: str):
        item = held.get(request_id)
        if item is None:
            raise KeyError(f"request {request_id!r} is not held for a handover here")
        return item

    def snapshot(self) -> dict:
        st = self.stats
        return {"handover_offered": st.num_offered, "handover_installed": st.num_installed,
                "handover_bytes": st.bytes_received, "handover_seconds": st.seconds,
                "handover_blocks_pulled": st.blocks_pulled,
                "handover_blocks_cached": st.blocks_cached,
                "handover_refused": st.num_refused, "handover_last_bytes": st.last_bytes,
                "handover_last_seconds": st.last_seconds,
                "handover_held": self.num_held}
