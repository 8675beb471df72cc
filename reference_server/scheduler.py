"""The engine core of one worker: sequences, admission, and which tokens go into each engine step.

One policy object per mode decides the batch of every step (article §6.2):

* ``colocated`` — a waiting prompt is prefilled to the end before any decode step runs again, so a
  long prompt stalls every running stream (prefill blocks decode).
* ``chunked``  — every step carries one decode token per running sequence plus prefill chunks up
  to a token budget, so a long prompt costs each running stream a bounded extra per step.
* ``prefill``  — prefill chunks only (the prefill pool of the disaggregated mode).

The ``decode`` role of the disaggregated mode uses the chunked policy for its local (short,
under-threshold) prefills. KV capacity for ``prompt + max_tokens`` is reserved at admission, so a
running sequence can never run out of blocks and no preemption is needed.

Besides wall time, each sequence keeps two clocks that do not depend on how busy the machine is:
the **modeled clock** (the sim engine's running sum of roofline step times, so a request's modeled
queue/decode time is the engine time that passed for it in the twin's world) and **CPU time** of the
engine steps that carried it (the process's less its other Python threads', reference_server/step_clock.py; a
step's CPU split over its items by token count). The performance gate compares these at tight tolerances where wall time would be noise (docs/slo.md).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Sequence

from reference_server.engine.base import Engine, SeqStep, VirtualKV
from reference_server.kv.block_manager import BlockManager, NoFreeBlocks
from reference_server.step_clock import StepClock

Policy = Literal["colocated", "chunked", "prefill"]


@dataclass(slots=True)
class Seq:
    rid: str
    tenant: str
    prompt: list[int]
    max_tokens: int
    ignore_eos: bool
    prefill_only: bool = False            # prefill worker: stop after the first token, ship KV
    # remote-prefilled KV handed over by the worker before admission: (kv, kv_from_token, first_token)
    remote_kv: tuple[Any, int, int] | None = None
    remote_gap: str = ""                  # why that KV could not be installed ("evicted", "range"): prefilled locally
    # blocks read from the host's KV store before admission: (kv, first block index)
    store_kv: tuple[Any, int] | None = None
    store_hit: int = 0                    # prompt tokens onboarded from the store (part of ``cached``)
    onboard_s: float = 0.0                # store lookup + read (+ modeled wire for the sim)
    # state
    block_table: list[int] = field(default_factory=list)
    cached: int = 0                       # prompt tokens served from the prefix cache
    computed: int = 0                     # positions with KV
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    # timings (seconds, this worker's clock)
    t_arrive: float = field(default_factory=time.perf_counter)
    t_start: float | None = None          # first step that included this sequence
    prefill_s: float = 0.0
    prefill_modeled_s: float | None = None   # sim engine: the roofline's seconds (before time scaling)
    kv_write_s: float = 0.0
    first_decode_s: float | None = None
    decode_s: float = 0.0
    decode_steps: int = 0
    # modeled clock (sim engine's modeled_seconds_total) at arrival, first step, first token, last step
    m_arrive: float | None = None
    m_start: float | None = None
    m_first: float | None = None
    m_end: float | None = None
    host_bound_s: float = 0.0             # sim engine: real seconds its steps ran past their modeled length
    # process CPU of the engine steps that carried it (its token share of each step)
    prefill_cpu_s: float = 0.0
    prefill_tokens: int = 0               # prompt tokens computed here (uncached)
    decode_cpu_s: float = 0.0

    @property
    def prefilling(self) -> bool:
        return self.computed < len(self.prompt)

    def timings(self) -> dict[str, float | int | None]:
        return {
            "queue_ms": 1e3 * ((self.t_start or time.perf_counter()) - self.t_arrive),
            "prefill_ms": 1e3 * self.prefill_s,
            "kv_write_ms": 1e3 * self.kv_write_s,
            "first_decode_ms": None if self.first_decode_s is None else 1e3 * self.first_decode_s,
            "decode_step_mean_ms": 1e3 * self.decode_s / self.decode_steps if self.decode_steps else None,
            "decode_steps": self.decode_steps,
            "store_hit_tokens": self.store_hit,
            "kv_onboard_ms": 1e3 * self.onboard_s,
            **({} if self.prefill_modeled_s is None else {"prefill_modeled_ms": 1e3 * self.prefill_modeled_s}),
            "prefill_cpu_ms": 1e3 * self.prefill_cpu_s,
            "prefill_tokens_computed": self.prefill_tokens,
            "decode_cpu_ms": 1e3 * self.decode_cpu_s,
            **self._modeled_spans(),
        }

    def _modeled_spans(self) -> dict[str, float]:
        """Modeled queue (arrival -> first step) and decode (first token -> last step) time, and the host-bound
        excess of the steps that carried it (sim engine only)."""
        out: dict[str, float] = {}
        if self.m_arrive is not None and self.m_start is not None:
            out["queue_modeled_ms"] = 1e3 * (self.m_start - self.m_arrive)
            out["host_bound_ms"] = 1e3 * self.host_bound_s
        if self.m_first is not None and self.m_end is not None and not self.prefill_only:
            out["decode_modeled_ms"] = 1e3 * max(0.0, self.m_end - self.m_first)
        return out


@dataclass(slots=True)
class StepResult:
    """What one step produced, for the worker to send: (seq, new tokens) and finished sequences."""

    emitted: list[tuple[Seq, list[int]]]
    prefilled: list[Seq]                  # prefill_only sequences whose prompt is done (KV to ship)
    finished: list[Seq]
    step_s: float
    prefill_tokens: int = 0               # prompt tokens this step computed (a real engine's rate estimate)


class Scheduler:
    def __init__(self, engine: Engine, blocks: BlockManager, *, policy: Policy, chunk_tokens: int,
                 max_num_seqs: int, eos_token_id: int | Sequence[int]) -> None:
        self.engine, self.blocks, self.policy = engine, blocks, policy
        self.chunk_tokens = max(1, chunk_tokens)
        self.max_num_seqs = max_num_seqs
        # a model may stop on several ids (Qwen2.5-Instruct: <|im_end|> and <|endoftext|>)
        self.eos = frozenset([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self._installed: list[Seq] = []       # remote-prefilled: first token known, to emit next step
        self._clock = StepClock()

    # ---- admission ----------------------------------------------------------------------------

    def modeled_clock(self) -> float | None:
        """The engine's modeled seconds so far (sim engine), None for engines that compute for real."""
        return getattr(self.engine, "modeled_seconds_total", None)

    def add(self, seq: Seq) -> None:
        seq.m_arrive = self.modeled_clock()
        self.waiting.append(seq)

    def abort(self, rid: str) -> str | None:
        """Drop a sequence wherever it is and free its blocks (its uncommitted ones go back to the free
        list). Returns the stage it was dropped in — ``queued`` (not admitted), ``prefill`` (prompt
        partly computed) or ``decode`` — or None if this scheduler does not hold it. Called between
        steps, so a prefill stops at the chunk boundary it has reached."""
        for i, s in enumerate(self.waiting):
            if s.rid == rid:
                del self.waiting[i]
                self.blocks.free(rid)
                return "queued"
        for s in self.running:
            if s.rid == rid:
                self.running = [x for x in self.running if x is not s]
                # remote KV installed, first token not sent yet
                self._installed = [x for x in self._installed if x is not s]
                self.blocks.free(rid)
                return "prefill" if s.prefilling else "decode"
        return None

    def _admit(self) -> list[Seq]:
        """FCFS admission while capacity allows; returns sequences that can never fit (to fail)."""
        rejected: list[Seq] = []
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            reserve = len(seq.prompt) + (0 if seq.prefill_only else seq.max_tokens)
            if -(-reserve // self.blocks.block_size) > self.blocks.num_blocks:
                self.waiting.popleft()
                seq.finish_reason = "error:prompt does not fit the KV budget"
                rejected.append(seq)
                continue
            try:
                alloc = self.blocks.allocate(seq.rid, seq.tenant, seq.prompt)
                seq.block_table = self.blocks.ensure_capacity(seq.rid, reserve)
            except NoFreeBlocks:
                self.blocks.free(seq.rid)
                break
            self.waiting.popleft()
            seq.cached = seq.computed = alloc.cached_tokens
            if seq.store_kv is not None:
                self._install_store_kv(seq)
            if seq.remote_kv is not None:
                try:
                    self._install_remote_kv(seq)
                except Exception as exc:  # noqa: BLE001 - this request's KV is refused, not the worker's batch
                    seq.remote_gap, seq.computed = f"install: {type(exc).__name__}: {exc}", seq.cached
            self.running.append(seq)
        return rejected

    def _install_remote_kv(self, seq: Seq) -> None:
        """Write transferred KV into this worker's blocks. Blocks already cached here are kept; if the
        local cache holds *less* than the sender assumed (evicted meanwhile), the KV has a gap, and if it
        does not carry exactly the blocks ``[kv_from, end of prompt)``, it is not this prompt's: either way
        the sequence is prefilled locally instead — slower, never wrong, and no other sequence affected."""
        kv, kv_from, first = seq.remote_kv  # type: ignore[misc]
        seq.remote_kv = None
        bs = self.blocks.block_size
        n_blocks = -(-len(seq.prompt) // bs)
        carried = kv.n_blocks if isinstance(kv, VirtualKV) else kv.shape[2]
        if kv_from % bs or carried != n_blocks - kv_from // bs:
            seq.remote_gap = "range"   # local prefill from seq.cached; reported as a recompute
            return
        if seq.cached < kv_from:
            seq.remote_gap = "evicted"
            return
        t0 = time.perf_counter()
        skip = (seq.cached - kv_from) // bs
        targets = seq.block_table[seq.cached // bs: n_blocks]
        if targets:
            self.engine.write_blocks(targets, slice_blocks(kv, skip, len(targets)))
        seq.kv_write_s += time.perf_counter() - t0
        seq.computed = len(seq.prompt)
        seq.output.append(first)
        self.blocks.commit(seq.rid, seq.prompt)
        self._installed.append(seq)

    def _install_store_kv(self, seq: Seq) -> None:
        """Write the blocks onboarded from the host's store after the local hit, and register them.
        If the local hit shrank since the read (evicted), the run no longer joins it: compute all."""
        kv, start = seq.store_kv  # type: ignore[misc]
        seq.store_kv = None
        bs = self.blocks.block_size
        have = seq.cached // bs
        end = start + (kv.n_blocks if isinstance(kv, VirtualKV) else kv.shape[2])
        if have < start or end <= have:
            return
        t0 = time.perf_counter()
        self.engine.write_blocks(seq.block_table[have:end], slice_blocks(kv, have - start, end - have))
        seq.kv_write_s += time.perf_counter() - t0
        seq.store_hit = (end - have) * bs
        seq.cached = seq.computed = end * bs
        self.blocks.commit(seq.rid, seq.prompt[:end * bs])

    # ---- one step -------------------------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> tuple[StepResult, list[Seq]]:
        rejected = self._admit()
        installed, self._installed = self._installed, []
        m0 = self.modeled_clock()
        for s in installed:          # remote-prefilled: the first token goes out now
            s.m_start = s.m_first = s.m_end = m0
            self._check_finish(s)
        items = self._plan()
        if items:
            batch = [st for _, st in items]
            t0 = self._clock.start()
            tokens = self.engine.step(batch)
            dt, cpu = self._clock.stop()
            res = self._apply(items, tokens, t0, dt, cpu, m0)
        else:
            res = StepResult([], [], [], 0.0)
            self._reap(res)
        res.emitted[:0] = [(s, [s.output[0]]) for s in installed]
        return res, rejected

    def _plan(self) -> list[tuple[Seq, SeqStep]]:
        decoding = [s for s in self.running if not s.prefilling and s.finish_reason is None]
        prefilling = [s for s in self.running if s.prefilling]
        items: list[tuple[Seq, SeqStep]] = []
        if self.policy == "chunked" or (self.policy == "colocated" and not prefilling):
            for s in decoding:
                pos = len(s.prompt) + len(s.output) - 1
                items.append((s, SeqStep(s.rid, [s.output[-1]], pos, s.block_table)))
        if self.policy == "colocated" or self.policy == "prefill":
            budget = self.chunk_tokens
        else:
            budget = max(self.chunk_tokens - len(items), min(self.chunk_tokens, 16))
        for s in prefilling:
            if budget <= 0:
                break
            n = min(budget, len(s.prompt) - s.computed)
            items.append((s, SeqStep(s.rid, s.prompt[s.computed:s.computed + n], s.computed, s.block_table)))
            budget -= n
        return items

    def _apply(self, items: list[tuple[Seq, SeqStep]], tokens: list[int], t0: float, dt: float, cpu: float,
               m0: float | None) -> StepResult:
        res = StepResult([], [], [], dt)
        m1 = self.modeled_clock()                          # sim engine: modeled time after the step
        cpu_per_token = cpu / max(1, sum(len(st.token_ids) for _, st in items))
        host_bound = getattr(self.engine, "last_host_bound_s", 0.0)
        for (s, st), tok in zip(items, tokens):
            s.host_bound_s += host_bound
            if s.t_start is None:
                s.t_start = t0
            if s.m_start is None:
                s.m_start = m0
            s.m_end = m1
            if s.prefilling:
                s.prefill_s += dt
                s.prefill_cpu_s += cpu_per_token * len(st.token_ids)
                s.prefill_tokens += len(st.token_ids)
                if m0 is not None and m1 is not None:
                    s.prefill_modeled_s = (s.prefill_modeled_s or 0.0) + (m1 - m0)
                s.computed += len(st.token_ids)
                res.prefill_tokens += len(st.token_ids)
                if s.prefilling:
                    continue
                s.m_first = m1
                self.blocks.commit(s.rid, s.prompt)
                s.output.append(int(tok))
                if s.prefill_only:
                    res.prefilled.append(s)
                    continue
                res.emitted.append((s, [int(tok)]))
            else:
                s.computed += 1
                s.decode_steps += 1
                s.decode_s += dt
                s.decode_cpu_s += cpu_per_token
                if s.first_decode_s is None:
                    s.first_decode_s = dt
                s.output.append(int(tok))
                res.emitted.append((s, [int(tok)]))
            self._check_finish(s)
        self._reap(res)
        return res

    def _reap(self, res: StepResult) -> None:
        for s in list(self.running):
            if s.finish_reason is not None or (s.prefill_only and not s.prefilling):
                self.running.remove(s)
                if not s.prefill_only:
                    res.finished.append(s)

    def _check_finish(self, s: Seq) -> None:
        if s.prefill_only:
            return
        if not s.ignore_eos and s.output and s.output[-1] in self.eos:
            s.finish_reason = "stop"
        elif len(s.output) >= s.max_tokens:
            s.finish_reason = "length"

    def release(self, s: Seq, before_free: Callable[[Seq], None] | None = None) -> None:
        """Free a sequence's blocks, keeping its full blocks (prompt + output with KV) cached;
        ``before_free`` sees the sequence with every full block committed (the store's put)."""
        try:
            self.blocks.commit(s.rid, s.prompt + s.output[:-1])
        except KeyError:
            return
        if before_free is not None:
            before_free(s)
        self.blocks.free(s.rid)


def slice_blocks(kv: Any, start: int, count: int) -> Any:
    """Blocks ``[start, start+count)`` of transferred KV (array ``[L, 2, n, B, H, D]`` or VirtualKV)."""
    if isinstance(kv, VirtualKV):
        per = kv.nbytes // max(1, kv.n_blocks)
        return VirtualKV(count, per * count)
    return kv[:, :, start:start + count]
