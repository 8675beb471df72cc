"""The router: decides per request where its prefill runs, and relays the request's events. The worker
processes and their connections belong to :mod:`reference_server.supervisor`.

Routing (:mod:`reference_server.routing`): the router asks the candidates themselves — a ``match``
round trip over the control connection, answered from each worker's live block manager and the host
KV store, never from a router-side mirror that would drift as soon as a worker evicts (~0.2 ms next
to a prefill of at least ``threshold`` tokens). The decode worker with the longest hit wins (prefix
affinity), ties going to the one with the fewest requests in flight; then ``--routing cost``
compares the estimated local and remote times (asking the prefill workers too) and
``--routing threshold`` applies the article's rule on the decode worker's hit.

Remote flow: the router sends ``generate(remote, kv_from=hit)`` to the decode worker and
``prefill(kv_from=hit, dest=decode worker's KV address)`` to the prefill worker; the prefill worker
computes the uncached part (with its own prefix cache), ships KV for blocks ``[kv_from, end)`` plus
the first token straight to the decode worker, and reports its timings to the router. The decode
worker streams every output token, the first included, so TTFT covers the KV transfer.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

from reference_server.config import ServerConfig
from reference_server.engine.base import ModelShape
from reference_server.faults import FaultInjector, FaultPlan, FaultRule
from reference_server.ipc import tokens_blob
from reference_server.metrics import RouterMetrics
from reference_server.routing import Backlog, Decision, Offer, cost_rule, threshold_rule
from reference_server.store_link import StoreLink
from reference_server.supervisor import Supervisor, WorkerHandle


class Overloaded(Exception):
    """The server's bounded queues are full: answer 429 with Retry-After."""


class RequestFailed(Exception):
    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(message)
        self.status = status


PREFILL_MATCH_TIMEOUT_S = 1.0   # a prefill worker's match is answered off its engine loop, in milliseconds


def _offer(h: WorkerHandle, r: dict[str, Any]) -> Offer:
    p = r.get("prefill_s")
    return Offer(h.name, int(r["hit"]), int(r.get("store_hit", 0)), None if p is None else float(p),
                 float(r.get("onboard_s", 0.0)), int(r.get("running", 0)), h.inflight)


@dataclass
class Completion:
    """Request as the router sees it (already tokenized)."""

    rid: str
    tenant: str
    prompt: list[int]
    max_tokens: int
    ignore_eos: bool
    fault: FaultRule | None = None     # an injected worker-side fault (reference_server.faults)


class Router:
    def __init__(self, cfg: ServerConfig, token: str | None = None) -> None:
        self.cfg = cfg
        # The internal token: workers refuse anyone else. Per launch, unless workers join from other hosts
        # (--join-port): then the one given to every host (--internal-token-file).
        self.token = token or secrets.token_hex(16)
        self.metrics = RouterMetrics()
        self.sup = Supervisor(cfg, self.token)  # the worker processes: start, heartbeat, restart
        # The supervisor's pools, the same lists: it replaces a restarted worker in place.
        self.prefill: list[WorkerHandle] = self.sup.prefill
        self.decode: list[WorkerHandle] = self.sup.decode    # decode or mixed workers
        self.inflight = 0
        self.store = StoreLink(cfg, self.sup)   # the shared KV store: made, attached, re-attached, counted
        self.backlog: dict[str, Backlog] = {}   # worker name -> estimated prefill seconds it still owes
        self._hardware: tuple[dict[str, dict[str, int]], dict[str, Any]] | None = None   # (joined, hardware())
        self.stopping = False                   # end_requests() was called: refuse new requests
        self.faults = FaultInjector(FaultPlan.parse(cfg.fault_spec)) if cfg.fault_spec is not None else None

    # ---- lifecycle: reference_server.supervisor -------------------------------------------------

    async def start(self, timeout_s: float = 300.0) -> None:
        await self.sup.start(timeout_s)
        await self.store.open()

    def hardware(self) -> dict[str, Any]:
        """What this server occupies now, joined workers included (:mod:`reference_server.hardware`): worked
        out (profiles loaded) once per set of joined workers, not on every trusted ``/health``."""
        from reference_server.hardware import server_hardware

        joined = self.sup.joined_hosts()
        if self._hardware is None or self._hardware[0] != joined:
            self._hardware = (joined, server_hardware(self.cfg, joined).to_dict())
        return self._hardware[1]

    def stop(self) -> None:
        self.sup.stop()
        self.store.close()

    async def store_report(self, workers: list[dict[str, Any]]) -> Any:
        """The store's counters for /metrics (None without a store): reference_server.store_link."""
        return await self.store.report(workers)

    async def store_down(self) -> list[str]:
        """Parts of the shared KV store that do not answer (probed off the event loop)."""
        return await self.store.down()

    @property
    def workers(self) -> list[WorkerHandle]:
        return self.prefill + self.decode

    # ---- routing --------------------------------------------------------------------------------

    def max_context(self) -> int | None:
        """Longest prompt + output the server takes: what every decode worker's whole KV pool holds, and no more
        than any worker's engine says it takes (a vLLM instance's ``max_model_len``, in its worker's info); None
        while no decode worker is registered (none has joined yet)."""
        if not self.decode:
            return None
        limits = [h.info["num_blocks"] * h.info["block_size"] for h in self.decode]
        limits += [int(h.info["max_model_len"]) for h in self.workers if h.info.get("max_model_len")]
        return min(limits)

    def block_size(self) -> int:
        """Tokens per KV block, the unit the prefix cache shares: ``/v1/models`` reports it so that a client
        can size a shared prefix in whole blocks."""
        return int(self.decode[0].info["block_size"])

    def capacity(self) -> int:
        return self.cfg.max_num_seqs * len(self.decode) + self.cfg.max_waiting

    async def _offers(self, req: Completion, blob: bytes,
                      timeout: float) -> tuple[list[tuple[WorkerHandle, Offer]], list[Offer]]:
        """Each live decode worker's offer, and each live prefill worker's when the cost rule needs them.
        A worker that cannot answer (declared down meanwhile, stopped; a prefill worker within
        ``PREFILL_MATCH_TIMEOUT_S``) is left out of this decision: the request fails (503) only when no
        decode worker answers."""
        live_d = [h for h in self.decode if not h.dead]
        if not live_d:
            raise RequestFailed("no decode worker is up (restarting); retry shortly", 503)
        live_p = [h for h in self.prefill if not h.dead] if self.cfg.routing == "cost" else []
        if self.cfg.mode != "disaggregated" and len(live_d) == 1:
            return [(live_d[0], Offer(live_d[0].name, 0, asked=False))], []
        msg = {"op": "match", "tenant": req.tenant}
        d_calls = asyncio.gather(*(h.call(dict(msg), blob, timeout=timeout) for h in live_d), return_exceptions=True)
        p_calls = asyncio.gather(*(h.call(dict(msg), blob, timeout=min(timeout, PREFILL_MATCH_TIMEOUT_S))
                                   for h in live_p), return_exceptions=True)
        d_replies, p_replies = await asyncio.gather(d_calls, p_calls)
        decode = [(h, _offer(h, r)) for h, r in zip(live_d, d_replies) if isinstance(r, dict)]
        if not decode:
            errs = [r for r in d_replies if isinstance(r, BaseException)]
            if not all(isinstance(e, (ConnectionError, asyncio.TimeoutError)) for e in errs):
                raise errs[0]
            raise RequestFailed(f"prefix match failed: {errs[0]}", 503)
        prefill = [_offer(h, r) for h, r in zip(live_p, p_replies) if isinstance(r, dict)]
        return decode, prefill

    def decide(self, prompt_tokens: int, decode: Offer, prefill: list[Offer]) -> Decision:
        """The configured rule on these offers (``prefill``: the prefill workers' offers; for the
        threshold rule only their names and loads matter)."""
        if self.cfg.routing == "threshold":
            if not prefill:
                prefill = [Offer(h.name, 0, inflight=h.inflight) for h in self.prefill if not h.dead]
            return threshold_rule(prompt_tokens, decode, prefill, threshold=self.cfg.remote_prefill_threshold,
                                  queue_bound=self.cfg.prefill_queue_bound)
        info = self.decode[0].info
        return cost_rule(prompt_tokens, decode, prefill, threshold=self.cfg.remote_prefill_threshold,
                         queue_bound=self.cfg.prefill_queue_bound,
                         backlog={name: b.seconds() for name, b in self.backlog.items()},
                         block_size=int(info["block_size"]),
                         block_nbytes=int(info["block_size"]) * ModelShape(**info["shape"]).kv_bytes_per_token(),
                         wire_bytes_per_s=float(info["wire_bytes_per_s"]))

    async def generate(self, req: Completion) -> AsyncIterator[dict[str, Any]]:
        """Events for one request: ``{"op": "tokens", "ids"}`` … then one ``{"op": "done", usage, timings}``.

        Raises :class:`Overloaded` before anything is sent when the queues are full, and
        :class:`RequestFailed` when a worker reports an error, when the decode worker is lost (the
        supervisor declared it down), or when ``request_timeout_s`` passes: every wait here is bounded
        by that deadline. A lost prefill worker is not an error: the decode worker prefills locally.
        """
        if self.stopping:
            raise RequestFailed("server shutting down", 503)
        if self.inflight >= self.capacity():
            raise Overloaded()
        self.inflight += 1
        self.metrics.waiting += 1
        started = False
        t_recv = time.perf_counter()
        ttft_s = 0.0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.request_timeout_s
        blob = tokens_blob(req.prompt)
        q: asyncio.Queue = asyncio.Queue()
        fault = req.fault
        applied = False
        d: WorkerHandle | None = None
        p: WorkerHandle | None = None
        finished = aborted = False
        booked: list[str] = []
        try:
            decodes, prefills = await self._offers(req, blob, min(10.0, deadline - loop.time()))
            if self.stopping:
                raise RequestFailed("server shutting down", 503)
            # A worker that answered its match and went down before the others answered is out of this
            # decision: sent to, it would drop the request without a word (its streams were failed already),
            # and the request would wait for its deadline. From here to the sends nothing awaits.
            decodes = [(h, o) for h, o in decodes if not h.dead]
            if not decodes:
                raise RequestFailed("no decode worker is up (restarting); retry shortly", 503)
            down = {h.name for h in self.prefill if h.dead}
            prefills = [o for o in prefills if o.worker not in down]
            d, d_offer = max(decodes, key=lambda ho: (ho[1].total_hit, ho[1].hit, -ho[0].inflight))
            decision = self.decide(len(req.prompt), d_offer, prefills)
            hit = d_offer.hit             # a remote prefill ships the blocks from the decode worker's own hit
            p = next((h for h in self.prefill if h.name == decision.prefill), None)
            p_offer = next((o for o in prefills if o.worker == decision.prefill), None)
            # Book the estimated prefill on the worker that will run it (the cost rule's queue term).
            est = (p_offer.onboard_s + (p_offer.prefill_s or 0.0)) if p_offer is not None else d_offer.prefill_s
            runner = p if p is not None else d
            if est:
                self.backlog.setdefault(runner.name, Backlog()).add(req.rid, est)
                booked.append(runner.name)
            d.streams[req.rid] = q
            d.inflight += 1
            base = {"rid": req.rid, "tenant": req.tenant, "max_tokens": req.max_tokens, "ignore_eos": req.ignore_eos}
            # Skip the worker's onboarding pass when its match just found nothing in the store for it.
            runs = p_offer if p is not None else d_offer
            onboard = runs is None or not runs.asked or runs.store_hit > 0
            route_ms = 1e3 * (time.perf_counter() - t_recv)
            if p is not None:
                p.streams[req.rid] = q
                p.inflight += 1
                d.send({"op": "generate", **base, "remote": True, "kv_from": hit}, blob)
                extra = ({"fault": fault.kind, "fault_seconds": fault.seconds}
                         if fault is not None and fault.kind.startswith("kv_") else {})
                p.send({"op": "prefill", **base, "kv_from": hit, "onboard": onboard, **extra,
                        "dest": {"host": d.host, "port": d.port, "kv_port": d.info.get("kv_port")}}, blob)
                applied = fault is not None and fault.kind.startswith("kv_")
                if fault is not None and fault.kind.endswith("_prefill"):
                    applied = self._hit(p, fault)      # while it prefills
            else:
                d.send({"op": "generate", **base, "onboard": onboard}, blob)
            chunks = 0
            if fault is not None and fault.kind.endswith("_decode") and fault.after_tokens == 0:
                applied = self._hit(d, fault)
            p_timings: dict[str, Any] | None = None
            p_failed: str | None = None
            done_msg: dict[str, Any] | None = None
            while True:
                try:
                    src, msg = await asyncio.wait_for(q.get(), deadline - loop.time())
                except asyncio.TimeoutError:
                    raise RequestFailed(f"request deadline exceeded ({self.cfg.request_timeout_s:g}s)", 504) from None
                op = msg.get("op")
                if op == "tokens":
                    if not started:
                        self._unbook(booked, req.rid)
                        started = True
                        self.metrics.waiting -= 1
                        self.metrics.running += 1
                        ttft_s = time.perf_counter() - t_recv
                        self.metrics.ttft.observe(ttft_s)
                    chunks += 1
                    if fault is not None and fault.kind.endswith("_decode") and chunks == fault.after_tokens:
                        applied = self._hit(d, fault)
                    yield msg
                elif op == "prefilled":          # from the prefill worker: free its queue slot
                    p_timings = msg.get("timings") or {}
                    self._unbook(booked, req.rid)
                    self._release(src, req.rid)
                elif op == "error":
                    if src is not p or p is None:
                        if msg.get("worker_lost"):
                            raise RequestFailed(f"{msg['error']}: the request was lost", 503)
                        raise RequestFailed(msg.get("error", "worker error"), int(msg.get("status", 500)))
                    # The prefill worker failed: the decode worker recomputes the prompt locally.
                    self._release(src, req.rid)
                    d.send({"op": "kv_failed", "rid": req.rid, "error": msg.get("error")})
                    p_timings, p_failed = {}, str(msg.get("error", "prefill worker error"))
                elif op == "done":
                    done_msg = msg
                # The prefill worker's report may arrive after the decode worker's "done".
                if done_msg is not None and (p is None or p_timings is not None):
                    finished = True
                    self.metrics.e2e.observe(time.perf_counter() - t_recv)
                    final = self._final(done_msg, p_timings, p is not None, route_ms, decision, p_failed)
                    if applied and fault is not None:     # a fault drawn but not applicable is not named
                        final["timings"]["fault"] = fault.kind
                    # this request's own observation of the TTFT histogram: lets a client compare per request
                    final["timings"]["ttft_ms"] = 1e3 * ttft_s
                    yield {"op": "done", **final}
                    return
        except (asyncio.CancelledError, GeneratorExit):
            # The HTTP handler stopped waiting: its client left (the handler was cancelled), or it
            # closed this generator (an injected stream fault). Abort the request on its workers below.
            aborted = not finished     # (closed after its last event: finished, not aborted)
            raise
        finally:
            self._unbook(booked, req.rid)
            self.inflight -= 1
            if started:
                self.metrics.running -= 1
            else:
                self.metrics.waiting -= 1
            for h in (p, d):
                if h is not None and req.rid in h.streams:
                    if not finished:
                        h.send({"op": "abort", "rid": req.rid})
                    self._release(h, req.rid)
            if aborted:
                self.metrics.aborted["streaming" if started else "waiting"] += 1
            if not finished:
                self.metrics.requests["aborted" if aborted else "failed"] += 1

    def end_requests(self, reason: str) -> None:
        """Stopping: every request in flight ends now with a 503 ``reason`` (its handler answers 503, or
        sends an error event and ``[DONE]`` after HTTP 200; its workers are told to abort it), and new
        ones are refused with 503."""
        self.stopping = True
        for h in self.workers:
            for rid, q in h.streams.items():
                q.put_nowait((None, {"op": "error", "rid": rid, "error": reason, "status": 503}))

    def _unbook(self, booked: list[str], rid: str) -> None:
        for name in booked:
            self.backlog[name].done(rid)
        booked.clear()

    @staticmethod
    def _hit(h: WorkerHandle, fault: FaultRule) -> bool:
        """Injected fault: SIGKILL the worker, or SIGSTOP it and SIGCONT it ``fault.seconds`` later (a child
        only: a joined worker's process is on another host)."""
        if h.joined:
            return False
        pid = h.process.pid

        def sig(s: signal.Signals) -> None:
            try:
                os.kill(pid, s)
            except ProcessLookupError:   # already gone (the supervisor killed what it found stopped)
                pass

        if fault.kind.startswith("kill_"):
            sig(signal.SIGKILL)
        else:
            sig(signal.SIGSTOP)
            asyncio.get_running_loop().call_later(fault.seconds, sig, signal.SIGCONT)
        return True

    @staticmethod
    def _release(h: WorkerHandle, rid: str) -> None:
        if h.streams.pop(rid, None) is not None:
            h.inflight -= 1

    def _final(self, msg: dict[str, Any], p_t: dict[str, Any] | None, remote: bool, route_ms: float,
               decision: Decision, p_failed: str | None = None) -> dict[str, Any]:
        d_t = msg.get("timings") or {}
        t = dict(d_t)
        t.update(decision.timings())
        if p_failed:
            t["prefill_failover"] = p_failed
            if d_t.get("kv_recomputed"):   # it failed before its KV arrived: the decode worker prefilled it all
                remote = False
        if remote and p_t is not None:
            # Queue and prefill happened on the prefill worker; if the KV was rejected and recomputed,
            # the decode worker's prefill time is added (that is what the request really paid).
            t["queue_ms"] = route_ms + float(p_t.get("queue_ms", 0.0))
            t["prefill_ms"] = float(p_t.get("prefill_ms", 0.0)) + float(d_t.get("prefill_ms", 0.0))
            t["kv_write_ms"] = float(p_t.get("kv_write_ms", 0.0)) + float(d_t.get("kv_write_ms", 0.0))
            t["prefill_cached_tokens"] = p_t.get("cached_tokens")
            if not d_t.get("kv_recomputed"):   # the prefill worker's onboarding served this prompt
                t["store_hit_tokens"] = int(p_t.get("store_hit_tokens", 0))
                t["kv_onboard_ms"] = float(p_t.get("kv_onboard_ms", 0.0))
            moved = p_t.get("transfer_bytes", d_t.get("transfer_bytes"))   # the sender's count, else the receiver's
            if moved is not None:
                t["transfer_bytes"] = int(moved)
            if "kv_transfer_ms" in p_t:          # TCP: the sender timed the wire up to the receiver's ack
                t["kv_transfer_ms"] = p_t["kv_transfer_ms"]
            # the request paid both workers' share of these (a recomputed prefill runs on the decode worker)
            for key in ("prefill_modeled_ms", "queue_modeled_ms", "prefill_cpu_ms", "prefill_tokens_computed"):
                if key in p_t:
                    t[key] = p_t[key] + d_t.get(key, 0)
        else:
            t["queue_ms"] = route_ms + float(d_t.get("queue_ms", 0.0))
        if not remote:
            # no transfer: no kv_transfer_ms / transfer_bytes, so a stage's mean is over the requests that had it
            # (a local request's 0.0 once divided one real transfer's 7.52 ms by 30 requests)
            t.pop("kv_transfer_ms", None)
            t.pop("transfer_bytes", None)
        t["prefill_location"] = "remote" if remote else "local"     # where the prompt was really prefilled
        cached = int(msg.get("cached_tokens", 0))
        if remote and p_t and not d_t.get("kv_recomputed"):
            cached = int(p_t.get("cached_tokens", cached))
        usage = {"prompt_tokens": int(msg["prompt_tokens"]), "completion_tokens": int(msg["completion_tokens"]),
                 "total_tokens": int(msg["prompt_tokens"]) + int(msg["completion_tokens"]),
                 "prompt_tokens_details": {"cached_tokens": cached}}
        self.metrics.observe(usage, t)
        return {"usage": usage, "timings": t, "finish_reason": msg.get("finish_reason") or "length"}

    async def worker_stats(self) -> list[dict[str, Any]]:
        async def one(h: WorkerHandle) -> dict[str, Any] | None:
            try:
                stats = (await h.call({"op": "stats"}, timeout=5.0))["stats"]
            except (asyncio.TimeoutError, ConnectionError, OSError):
                return None
            h.note_store(stats.get("store"))     # what the router keeps if it goes down (store_link)
            return stats

        got = await asyncio.gather(*(one(h) for h in self.workers))
        return [s for s in got if s is not None]
