"""Incremental scanner for OpenAI-style SSE streams: the client's hot loop.

Why a byte scanner and not ``json.loads`` per chunk: a benchmark client must cost far less CPU per token than
the server it measures. For every ``data:`` event we only need three facts — did it carry output tokens, how
many, and is it the usage / error / end event — and ``bytes.find`` bounded to the event answers them without
slicing, decoding or building a dict. The rare events that need their content (the usage chunk, the server's
timing breakdown, an error) are kept by reference and parsed once at the end.

Token count of an event (see docs/metrics.md, "What counts as a token"):

* the event carries a cumulative ``usage.completion_tokens`` and so did every earlier token-carrying event
  (vLLM/SGLang ``continuous_usage_stats``, the reference server): the count is the increase since the previous
  event — exact. Usage first seen on a later content event is the stream's total, not that event's share;
* otherwise 1 if any of ``text``, ``content``, ``reasoning_content``, ``reasoning`` is a non-empty string, or
  ``tool_calls`` is present; else 0. :func:`paasbench.client.tokens.settle` later reconciles these counts with
  the final ``usage.completion_tokens``. An event with a choice but no text and no ``role`` counts 0, but the
  first one's arrival is kept (``silent_s``): when usage says tokens came and no event carried text (vLLM's one
  token of ``max_tokens=1`` can be a byte of a character, streamed as ``"text": ""``), that is their arrival.

JSON key matching is safe against prompt/answer text: inside a JSON string every ``"`` is escaped, so the
byte sequence ``"key"`` followed by ``:`` only occurs as a real key.
"""

from __future__ import annotations

_CONTENT_KEYS = (b'"text"', b'"content"', b'"reasoning_content"', b'"reasoning"')
_FAST_KEYS = (b'"text":"', b'"content":"', b'"text": "', b'"content": "')
_MAX_PARTIAL = 64 << 20  # an unterminated line this long is not an SSE stream

Event = tuple[bytes, int, int]  # (buffer, start, end) of one event's JSON payload, kept without copying


def _value(buf: bytes, i: int, end: int) -> int:
    """Index of the value after a key whose closing quote ends at ``i``; -1 if no ``:`` follows (not a key)."""
    while i < end and buf[i] == 32:
        i += 1
    if i >= end or buf[i] != 58:  # ':'
        return -1
    i += 1
    while i < end and buf[i] == 32:
        i += 1
    return i


def _int_at(buf: bytes, i: int, end: int) -> int | None:
    j = i
    while j < end and 48 <= buf[j] <= 57:
        j += 1
    return int(buf[i:j]) if j > i else None


def _has_content(buf: bytes, s: int, e: int) -> bool:
    for key in _CONTENT_KEYS:
        j = buf.find(key, s, e)
        while j >= 0:
            v = _value(buf, j + len(key), e)
            if v >= 0 and v + 1 < e and buf[v] == 34 and buf[v + 1] != 34:  # a non-empty string
                return True
            j = buf.find(key, j + 1, e)
    j = buf.find(b'"tool_calls"', s, e)
    if j >= 0:
        v = _value(buf, j + 12, e)
        return v >= 0 and v < e and buf[v] == 91  # '['
    return False


def _no_choices(buf: bytes, s: int, e: int) -> bool:
    j = buf.find(b'"choices"', s, e)
    if j < 0:
        return True
    v = _value(buf, j + 9, e)
    if v < 0 or buf[v] != 91:  # '['
        return True
    v += 1
    while v < e and buf[v] == 32:
        v += 1
    return v < e and buf[v] == 93  # ']'


class StreamParser:
    """Feed raw body bytes as they arrive; read the per-chunk timeline and the end-of-stream facts after."""

    __slots__ = ("_rest", "raw", "times", "counts", "cum", "exact", "done", "usage_event", "error", "collect",
                 "_key", "_chunk_usage", "silent_s")

    def __init__(self, *, keep_raw: bool = True, collect: list[Event] | None = None) -> None:
        self._rest = b""
        self.raw: list[bytes] | None = [] if keep_raw else None  # references only; for the slow path
        self.times: list[float] = []      # arrival time of each token-carrying event
        self.counts: list[int] = []       # tokens in each such event
        self.cum = 0                      # tokens so far (cumulative usage when the server sends it)
        self.exact = False                # some count came from cumulative usage
        self.done = False                 # saw data: [DONE]
        self.usage_event: Event | None = None     # last event whose "usage" is an object
        self.error: tuple[str, str] | None = None  # (error kind, message)
        self.collect = collect            # slow path: token-carrying events are appended here
        # arrival of the first event with a choice but no text and no role (a token whose text is empty: a
        # byte of a character not complete yet, which vLLM streams as "text": ""); it times the first token
        # only where usage says tokens came and no event carried text (tokens.settle)
        self.silent_s: float | None = None
        # Fast path, learnt from the stream's first content event: the key its content uses, with the
        # separator the server writes (b'"text":"', b'"content": "', ...), and whether content events carry
        # usage (None: not known yet)
        self._key = b'"text":"'
        self._chunk_usage: bool | None = None

    def feed(self, data: bytes, now: float) -> None:
        if self.raw is not None:
            self.raw.append(data)
        buf = self._rest + data if self._rest else data
        find = buf.find
        key, klen = self._key, len(self._key)
        fast = self._chunk_usage is False and self.collect is None
        pos = 0
        while True:
            nl = find(b"\n", pos)
            if nl < 0:
                break
            if buf.startswith(b"data:", pos):
                s = pos + 6 if buf[pos + 5] == 32 else pos + 5
                e = nl - 1 if buf[nl - 1] == 13 else nl
                if fast and buf[e - 1] == 125 and buf[e - 2] != 125 and buf[s] == 123:
                    # the common event: one content delta, no usage; a non-empty string value after the
                    # content key means it carries a token and cannot be an error event. An event ending
                    # "}}" may end with a usage object (some servers put the totals on the last content
                    # event): that one takes the full scan, or prompt/cached/completion tokens are lost
                    k = find(key, s, e)
                    if k >= 0 and buf[k + klen] != 34:
                        self.times.append(now)
                        self.counts.append(1)
                        self.cum += 1
                        pos = nl + 1
                        continue
                if s < e:
                    self._event(buf, s, e, now)
                    if not fast and self._chunk_usage is False and self.collect is None:
                        fast, key, klen = True, self._key, len(self._key)  # learnt: fast from here on
            pos = nl + 1
        self._rest = buf[pos:] if pos < len(buf) else b""
        if len(self._rest) > _MAX_PARTIAL:
            self.error = ("protocol", f"no line break in {len(self._rest)} bytes of stream")

    def _event(self, buf: bytes, s: int, e: int, now: float) -> None:
        if buf[s] != 123 or buf[e - 1] != 125:  # not '{' ... '}'
            if buf.startswith(b"[DONE]", s):
                self.done = True
            else:
                self.error = ("protocol", f"non-JSON data line: {buf[s:min(e, s + 120)]!r}")
            return
        n = -1
        k = buf.find(b'"usage"', s, e)
        if k >= 0:
            v = _value(buf, k + 7, e)
            if v >= 0 and buf[v] == 123:
                self.usage_event = (buf, s, e)
                # cumulative usage on a chunk with choices, from the first token on = continuous usage
                # stats; on the final "choices": [] chunk, or on a content event after content events
                # without usage (the totals on the last content event), it is the total, which settle()
                # spreads over the events instead of crediting it all to this one
                per_chunk = not self.counts or self.exact
                j = buf.find(b'"completion_tokens"', v, e) if per_chunk and not _no_choices(buf, s, e) else -1
                j = _value(buf, j + 19, e) if j >= 0 else -1
                cum = _int_at(buf, j, e) if j >= 0 else None
                if cum is not None:
                    n = max(0, cum - self.cum)
                    self.cum = max(self.cum, cum)
                    self.exact = True
        k = buf.find(b'"error"', s, e)
        if k >= 0:
            v = _value(buf, k + 7, e)
            if v >= 0 and buf[v] in (123, 34):  # an object or a message string, not null
                self.error = ("protocol", f"error event in stream: {buf[s:min(e, s + 300)].decode(errors='replace')}")
                return
        if n < 0:
            n = 1 if _has_content(buf, s, e) else 0
            self.cum += n
            if n and self._chunk_usage is None:
                self._learn(buf, s, e)
        elif n and self._chunk_usage is None:
            self._chunk_usage = True
        if n:
            self.times.append(now)
            self.counts.append(n)
            if self.collect is not None:
                self.collect.append((buf, s, e))
        elif (self.silent_s is None and not self.times and not _no_choices(buf, s, e)
              and buf.find(b'"role"', s, e) < 0):
            self.silent_s = now

    @property
    def fast_path(self) -> bool:
        """Whether content events are now recognised by one key search (see :meth:`feed`)."""
        return self._chunk_usage is False and self.collect is None

    def _learn(self, buf: bytes, s: int, e: int) -> None:
        """First content event without cumulative usage: enable the fast path for its key and separator
        (compact JSON, or a space after the colon as Python's ``json.dumps`` and some servers write it)."""
        for key in _FAST_KEYS:
            k = buf.find(key, s, e)
            if k >= 0 and buf[k + len(key)] != 34:
                self._key, self._chunk_usage = key, False
                return
