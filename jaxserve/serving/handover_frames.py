"""The frames a prefill or decode engine process takes from the front of disaggregated serving
(serving/disagg.py), on top of the socket protocol (protocol.py). An engine with the engines'
secret (engine_secret.py) first sends {"type": "challenge", "nonce"}, and takes no other frame
before {"type": "hello", "nonce", "proof"}, which it answers with {"type": "hello", "proof"};
anything else is refused with the error "unauthorized" and the connection closed.

    {"type": "engine_info"} -> {"type": "engine_info", "role", "transfer_address",
                                "block_size", "num_kv_blocks", "max_num_seqs"}
  prefill (a "generate" with stream=True runs the prompt; its first token comes as a "token"
  frame, and the request then waits for its handover):
    {"type": "offer", "id", "first_block", "num_blocks", "name"}
        -> {"type": "offered", "id", "bytes"}   (blocks offered for one pull under the name:
                                                 a fresh random string of up to 64 characters)
    {"type": "release", "id"}   (pulled: its blocks go back; a "done" frame with
                                 finish_reason "handover" ends it)
  decode:
    {"type": "accept", ...the fields of "generate" (its adapter named in full)...,
     "first_token": int, "first_logprob": entry (params.logprobs set)}
        -> {"type": "reserved", "id", "first_block", "num_blocks"}, or an error "no_room"
    {"type": "pull", "id", "address", "name"}
        -> {"type": "pulled", "id", "bytes", "seconds"}, then its "token" and "done" frames
           as for a "generate"; or an error "handover_failed" (the request is aborted)
"""

from __future__ import annotations

import asyncio
import time

from jaxserve.config import Role
from jaxserve.engine.handover import NoRoom
from jaxserve.serving import engine_secret
from jaxserve.serving.loras import LoRAError
from jaxserve.serving.protocol import ProtocolError, logprob_from_wire, parse_generate

PULL_TIMEOUT_S = 60.0  # an offer not pulled by then is dropped; a pull waits no longer
MAX_NAME = 64


class HandoverFrames:
    TYPES = ("engine_info", "offer", "release", "accept", "pull")
    _ROLE_OF = {"offer": Role.PREFILL, "release": Role.PREFILL, "accept": Role.DECODE,
                "pull": Role.DECODE}

    def __init__(self, front):
        self.front = front
        self.core = front.core
        self.role = self.core.engine.config.role
        self.replica = self.core.replicas.replicas[0]  # a role engine is one replica
        self._to_pull: dict[str, int] = {}  # decode: engine id -> blocks it reserved

    async def handle(self, conn, msg: dict) -> None:
        kind, cid = msg["type"], msg.get("id")
        want = self._ROLE_OF.get(kind)
        if want is not None and want is not self.role:
            conn.error("unknown_type", f"{kind!r} is for a {want} engine; this one is "
                                       f"{self.role}", cid if isinstance(cid, str) else None)
        elif kind == "engine_info":
            e = self.core.engine
            conn.send({"type": "engine_info", "role": str(self.role),
                       "transfer_address": e.handover.address,
                       "block_size": e.config.block_size,
                       "num_kv_blocks": e.block_manager.num_blocks,
                       "max_num_seqs": e.config.max_num_seqs})
        elif kind == "accept":
            await self._accept(conn, msg)
        elif not isinstance(cid, str) or cid not in conn.active:
            conn.error("not_found", f"no active request with id {cid!r}",
                       cid if isinstance(cid, str) else None)
        elif kind == "offer":
            await self._offer(conn, cid, msg)
        elif kind == "release":
            engine_id = conn.active[cid]
            await self.replica.call(lambda e: e.handover.release(engine_id))
        else:
            await self._pull(conn, cid, msg)

    async def _offer(self, conn, cid: str, msg: dict) -> None:
        engine_id = conn.active[cid]
        try:
            first, n = (_int(msg, k) for k in ("first_block", "num_blocks"))
            uuid = self._uuid(msg)
            nbytes = await self.replica.call(lambda e: e.handover.offer(
                engine_id, first, n, uuid, PULL_TIMEOUT_S))
        except (ProtocolError, KeyError, ValueError) as e:
            conn.error("invalid_request", f"offer: {e}", cid)
            return
        conn.send({"type": "offered", "id": cid, "bytes": nbytes})

    async def _accept(self, conn, msg: dict) -> None:
        try:
            req = parse_generate(msg)
            if req.prompt_token_ids is None:
                raise ProtocolError("invalid_field", "prompt_token_ids: an accept carries the "
                                                     "prompt's ids", req.id)
            first = _int(msg, "first_token")
            first_lp = msg.get("first_logprob")
            first_lp = logprob_from_wire(first_lp) if isinstance(first_lp, dict) else None
            lora = self.core.loras.from_frame(req)
        except ProtocolError as e:
            conn.error(e.code, e.message, e.request_id)
            return
        except LoRAError as e:
            conn.error("invalid_field", str(e), req.id)
            return
        if req.id in conn.active:
            conn.error("duplicate_id", f"id {req.id!r} is already active on this connection",
                       req.id)
            return
        engine_id = f"c{conn.number}-{req.id}"
        conn.active[req.id] = engine_id
        try:
            stream, r = await self.core.replicas.take_over(
                engine_id, prompt_token_ids=req.prompt_token_ids, params=req.params,
                first_token=first, first_logprob=first_lp, priority=req.priority,
                cache_salt=req.cache_salt, lora_request=lora)
        except (NoRoom, ValueError) as e:  # no_room: the front waits or goes elsewhere
            conn.active.pop(req.id, None)
            conn.error("no_room" if isinstance(e, NoRoom) else "invalid_request", str(e), req.id)
            return
        self._to_pull[engine_id] = r.num_blocks
        conn.send({"type": "reserved", "id": req.id, "first_block": r.first_block,
                   "num_blocks": r.num_blocks})
        self.front.start_pump(conn, req.id, engine_id, stream, req.stream)

    async def _pull(self, conn, cid: str, msg: dict) -> None:
        engine_id = conn.active[cid]
        n = self._to_pull.pop(engine_id, None)
        address = msg.get("address")
        try:
            uuid = self._uuid(msg)
            if n is None or not isinstance(address, str):
                raise ValueError("give the address of an offer for a request accepted here")
            t0 = time.perf_counter()
            arrays = (await asyncio.to_thread(self.core.engine.handover.pull, address, uuid, n,
                                              PULL_TIMEOUT_S) if n else [])
            seconds = time.perf_counter() - t0
            nbytes = sum(a.nbytes for a in arrays)
            await self.replica.call(
                lambda e: e.handover.install(engine_id, arrays, nbytes, seconds))
        except Exception as e:  # noqa: BLE001 - a lost peer, a bad frame: this request only
            self.replica.abort(engine_id)
            conn.error("handover_failed", f"pulling its K/V from {address} failed: "
                                          f"{type(e).__name__}: {e}", cid)
            return
        conn.send({"type": "pulled", "id": cid, "bytes": nbytes, "seconds": seconds})

    def _uuid(self, msg: dict) -> int:
        """The transfer server's number for the offer the frame names."""
        name = msg.get("name")
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME:
            raise ProtocolError("invalid_field", f"name: must be a string of 1 to {MAX_NAME} "
                                                 f"characters", msg.get("id"))
        return engine_secret.transfer_uuid(self.front.secret, name)


def _int(msg: dict, key: str) -> int:
    v = msg.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ProtocolError("invalid_field", f"{key}: must be a non-negative int",
                            msg.get("id"))
    return v
