"""The client side of ``benchmarks/serve.py``: request lengths from a stated distribution, random-token prompts,
Poisson arrivals, streamed completions read as they come (time to the first token, time per output token), the
server's Prometheus metrics sampled once a second, and the summary of one run. Nothing here starts a server.

Times are seconds from the start of the load phase (``time.perf_counter``), taken when the client reads a chunk.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import json
import math
import random
import re
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

try:
    import httpx
except ImportError:
    try:  # newer openai releases bring the same client under this name
        import httpx2 as httpx
    except ImportError:
        raise SystemExit("benchmarks/serve.py talks to the server through httpx: pip install httpx") from None


# -- what is sent --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Lengths:
    """Token counts drawn uniformly from the whole numbers ``low..high``, both included (equal: a fixed count)."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str, flag: str) -> Lengths:
        """``"32768"`` (fixed) or ``"1024:4096"`` (uniform); else a ``ValueError`` in one line naming ``flag``."""
        parts = str(text).split(":")
        try:
            values = [int(p) for p in parts]
        except ValueError:
            values = []
        if len(values) not in (1, 2):
            raise ValueError(f"{flag} takes a token count N or a range LOW:HIGH of whole numbers, got {text!r}")
        low, high = values[0], values[-1]
        if low < 1:
            raise ValueError(f"{flag} takes token counts of at least 1, got {text!r}")
        if high < low:
            raise ValueError(f"{flag} {text}: a range LOW:HIGH needs HIGH at least LOW")
        return cls(low, high)

    def draw(self, rng: np.random.Generator) -> int:
        return int(rng.integers(self.low, self.high + 1))

    @property
    def mean(self) -> float:
        return (self.low + self.high) / 2

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}:{self.high}"


@dataclass(frozen=True)
class Workload:
    """The requests of a run: request ``i`` is the same under every policy, whatever order they are sent in."""

    prompt: Lengths
    output: Lengths
    vocab: int
    seed: int = 0
    staggered: int = 0  # the first requests that start part-way into their traces (see request)

    def token_range(self) -> tuple[int, int]:
        """Prompt ids come from ``[low, high)``: clear of the ends of the vocabulary, where special tokens sit."""
        margin = min(1000, self.vocab // 4)
        return margin, self.vocab - margin

    def request(self, index: int, warm_up: bool = False) -> tuple[list[int], int]:
        """Request ``index`` (of the load, or of the warm-up before it): its prompt (random token ids) and its output
        length.

        The first ``staggered`` requests of the load start part-way into their traces: ``a`` of a request's ``out``
        tokens, drawn uniformly from ``0..out - 1``, move into its prompt (a prompt of ``n + a`` ids, ``out - a`` to
        decode). A closed load's first requests would otherwise all hold contexts of their prompts' length at once
        and end together; staggered, the rows hold the spread of contexts a steady load holds from the start, and
        request ``i``'s context at its end (``n + out``) is unchanged."""
        rng = np.random.default_rng([self.seed, int(warm_up), index])
        n, out = self.prompt.draw(rng), self.output.draw(rng)
        if index < self.staggered and not warm_up:
            age = int(np.random.default_rng([self.seed, 2, index]).integers(0, out))
            n, out = n + age, out - age
        low, high = self.token_range()
        return rng.integers(low, high, n).tolist(), out


def poisson_gaps(rate: float, seed: int) -> Iterator[float]:
    """Seconds between the arrivals of a Poisson process of ``rate`` requests per second: exponential gaps of mean
    ``1 / rate`` from a seeded RNG, so every policy gets the same arrivals."""
    rng = random.Random(seed)
    while True:
        yield rng.expovariate(rate)


# -- one request ---------------------------------------------------------------------------------------------------
@dataclass
class Record:
    """One request as the client saw it."""

    index: int
    prompt_tokens: int
    asked: int  # max_tokens (ignore_eos: the tokens it must return)
    sent: float
    times: list[float] = field(default_factory=list)  # when each chunk that carried tokens was read
    counts: list[int] = field(default_factory=list)  # the tokens in that chunk
    reported: int | None = None  # usage.completion_tokens, where the server reports it
    ended: float | None = None
    error: str | None = None
    cut: bool = False  # still running when the load phase ended

    @property
    def tokens(self) -> int:
        return self.reported if self.reported is not None else sum(self.counts)

    @property
    def done(self) -> bool:
        return self.ended is not None and not self.cut and self.error is None

    @property
    def ttft(self) -> float | None:
        return self.times[0] - self.sent if self.times else None

    @property
    def tpot(self) -> float | None:
        """(last token's time − first token's time) / the tokens after the first chunk's."""
        after = self.tokens - (self.counts[0] if self.counts else 0)
        return (self.times[-1] - self.times[0]) / after if after > 0 and len(self.times) > 1 else None

    def tokens_by(self, t: float) -> int:
        """Tokens read by time ``t`` (the reported count once the last chunk is in)."""
        if self.times and t >= self.times[-1] and self.reported is not None:
            return self.reported
        return sum(self.counts[:bisect.bisect_right(self.times, t)])

    def tpot_within(self, start: float, end: float) -> float | None:
        """Time per output token over this request's chunks read in ``[start, end]``."""
        i, j = bisect.bisect_left(self.times, start), bisect.bisect_right(self.times, end) - 1
        after = sum(self.counts[i + 1:j + 1])
        return (self.times[j] - self.times[i]) / after if j > i and after > 0 else None

    def decoding_at(self, t: float, end: float) -> bool:
        """Whether the request held a decoding row at ``t``: its first token read, its last not yet (a request cut
        at ``end`` decoded until then)."""
        last = end if self.cut else (self.times[-1] if self.times else -1.0)
        return bool(self.times) and self.times[0] <= t < last


def read_event(payload: str) -> tuple[int, int | None, str | None, bool]:
    """One SSE ``data:`` payload of a streamed completion → (tokens it carries, ``usage.completion_tokens`` where it
    reports usage, an error message or None, whether it ends the stream). A choice's ``token_ids`` count where
    present; else a choice is one token unless it only closes the stream (no text, a ``finish_reason``)."""
    if payload == "[DONE]":
        return 0, None, None, True
    try:
        event = json.loads(payload)
    except json.JSONDecodeError:
        return 0, None, f"a stream event that is not JSON: {payload[:80]!r}", False
    if not isinstance(event, dict):
        return 0, None, f"a stream event that is not an object: {payload[:80]!r}", False
    if event.get("error"):
        error = event["error"]
        return 0, None, one_line(error.get("message", error) if isinstance(error, dict) else error), False
    usage = event.get("usage")
    reported = usage.get("completion_tokens") if isinstance(usage, dict) else None
    tokens = 0
    for choice in event.get("choices") or []:
        ids = choice.get("token_ids")
        if isinstance(ids, list):
            tokens += len(ids)
        elif choice.get("text") or choice.get("finish_reason") is None:
            tokens += 1
    return tokens, reported if isinstance(reported, int) else None, None, False


def one_line(message: Any, limit: int = 200) -> str:
    text = " ".join(str(message).split())
    return text if len(text) <= limit else text[:limit - 1] + "…"


def error_of(status: int, body: bytes) -> str:
    """``HTTP 400: <the error's message>`` from an OpenAI-style error body (or its first characters)."""
    try:
        error = json.loads(body).get("error", {})
        message = error.get("message") if isinstance(error, dict) else error
    except (ValueError, AttributeError):
        message = None
    return f"HTTP {status}: {one_line(message or body.decode(errors='replace') or '(no body)')}"


async def complete(client: httpx.AsyncClient, body: bytes, record: Record, clock: Callable[[], float]) -> None:
    """POST one streamed completion and read it into ``record``; a failure is written there, never raised (a
    cancelled request is marked ``cut`` and the cancellation passes on)."""
    try:
        async with client.stream("POST", "/v1/completions", content=body,
                                 headers={"content-type": "application/json"}) as response:
            if response.status_code != 200:
                record.error = error_of(response.status_code, await response.aread())
                return
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                tokens, reported, error, end = read_event(line[5:].strip())
                now = clock()
                if error:
                    record.error = error
                    return
                if tokens:
                    record.times.append(now)
                    record.counts.append(tokens)
                if reported is not None:
                    record.reported = reported
                if end:
                    break
        if record.tokens < record.asked:
            record.error = f"{record.tokens} tokens of the {record.asked} asked for"
    except asyncio.CancelledError:
        record.cut = True
        raise
    except httpx.HTTPError as e:
        record.error = one_line(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
    finally:
        record.ended = clock()


def request_body(model: str, prompt: list[int], max_tokens: int) -> bytes:
    return json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                       "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True},
                       "return_token_ids": True}).encode()


# -- the server's metrics ------------------------------------------------------------------------------------------
METRICS = {"running": "requests_running", "waiting": "requests_waiting", "slots_in_use": "slots_in_use",
           "kv_cache_bytes": "kv_cache_bytes", "generated_tokens": "generated_tokens",
           "tokens_per_s": "tokens_per_second", "prefill_seconds": "prefill_seconds",
           "prefill_tokens": "prefill_tokens", "decode_seconds": "decode_seconds", "decode_steps": "decode_steps",
           "kv_pages_total": "kv_pages", "kv_pages_used": "kv_pages_used", "preemptions": "preemptions"}
COUNTERS = ("generated_tokens", "prefill_seconds", "prefill_tokens", "decode_seconds", "decode_steps", "preemptions")
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{[^}]*\})?\s+(\S+)")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text → the values of :data:`METRICS`, each found by the end of its name (any prefix, a ``_total``
    suffix allowed, labels ignored, label sets summed); a metric not there is left out."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line.strip())
        if not m:
            continue
        try:
            value = float(m.group(2))
        except ValueError:
            continue
        name = m.group(1).removesuffix("_total")
        for key, suffix in METRICS.items():
            if name == suffix or name.endswith("_" + suffix):
                values[key] = values.get(key, 0.0) + value
    return values


async def loop_lag(lags: list[float], clock: Callable[[], float], every: float = 0.1) -> None:
    """Append how late each ``every``-second sleep of this event loop wakes, until cancelled: a loop busy reading
    streams wakes late, and reads its chunks late too (the client's share of the times it measures)."""
    while True:
        due = clock() + every
        await asyncio.sleep(every)
        lags.append(max(0.0, clock() - due))


async def sample_metrics(client: httpx.AsyncClient, samples: list[tuple[float, dict[str, float]]],
                         clock: Callable[[], float], every: float = 1.0) -> None:
    """Append ``(time, parse_metrics(/metrics))`` every ``every`` seconds until cancelled (a miss is skipped)."""
    while True:
        t = clock()
        try:
            response = await client.get("/metrics", timeout=5.0)
            if response.status_code == 200:
                samples.append((t, parse_metrics(response.text)))
        except httpx.HTTPError:
            pass
        await asyncio.sleep(max(0.0, every - (clock() - t)))


# -- the load ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Load:
    """``concurrency`` clients each sending the next request when its last ended, or Poisson arrivals at ``rate``
    requests per second; for ``duration`` seconds (requests still running then are cut) or ``requests`` requests
    (the phase ends with the last)."""

    concurrency: int | None = None
    rate: float | None = None
    duration: float | None = None
    requests: int | None = None
    seed: int = 0


@dataclass
class Run:
    records: list[Record]
    samples: list[tuple[float, dict[str, float]]]  # /metrics once a second
    lags: list[float]  # the client's event loop: seconds late of its 0.1 s sleeps
    wall: float  # seconds of the load phase


def http_client(base_url: str, timeout: float) -> httpx.AsyncClient:
    """An HTTP client for one server: no cap on connections (arrivals may pile up), ``timeout`` per read."""
    return httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(timeout, connect=30.0),
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))


async def run_load(base_url: str, model: str, workload: Workload, load: Load, timeout: float) -> Run:
    """Send ``workload`` as ``load`` says, sampling ``/metrics`` once a second beside it."""
    records: list[Record] = []
    samples: list[tuple[float, dict[str, float]]] = []
    lags: list[float] = []
    indices = itertools.count()
    async with http_client(base_url, timeout) as http:
        t0 = time.perf_counter()

        def clock() -> float:
            return time.perf_counter() - t0

        def next_index() -> int | None:
            if load.duration is not None and clock() >= load.duration:
                return None
            i = next(indices)
            return None if load.requests is not None and i >= load.requests else i

        async def send(i: int) -> None:
            prompt, out = workload.request(i)
            body = request_body(model, prompt, out)
            record = Record(i, len(prompt), out, clock())
            records.append(record)
            await complete(http, body, record, clock)

        async def worker() -> None:
            while (i := next_index()) is not None:
                await send(i)

        spawned: list[asyncio.Task] = []

        async def arrivals() -> None:
            at = 0.0
            for gap in poisson_gaps(load.rate, load.seed):
                at += gap
                if load.duration is not None and at >= load.duration:
                    break
                await asyncio.sleep(max(0.0, at - clock()))
                if (i := next_index()) is None:
                    break
                spawned.append(asyncio.create_task(send(i)))
            await asyncio.gather(*spawned)

        watchers = [asyncio.create_task(sample_metrics(http, samples, clock)), asyncio.create_task(loop_lag(lags, clock))]
        senders = [asyncio.create_task(worker()) for _ in range(load.concurrency)] if load.concurrency else \
            [asyncio.create_task(arrivals())]
        try:
            await asyncio.wait(senders, timeout=load.duration)
        finally:
            for task in [*senders, *spawned]:
                task.cancel()
            await asyncio.gather(*senders, *spawned, return_exceptions=True)
            for task in watchers:
                task.cancel()
            await asyncio.gather(*watchers, return_exceptions=True)
        wall = load.duration if load.duration is not None else max((r.ended for r in records), default=0.0)
    return Run(records, samples, lags, wall)


async def warm_up(base_url: str, model: str, workload: Workload, count: int, timeout: float) -> list[Record]:
    """``count`` requests sent together before the load (prompts of the workload's lengths, at most 16 new tokens
    each): the server's first calls, kept out of the figures."""
    async with http_client(base_url, timeout) as http:
        t0 = time.perf_counter()

        def clock() -> float:
            return time.perf_counter() - t0

        records, bodies = [], []
        for k in range(count):
            prompt, out = workload.request(k, warm_up=True)
            records.append(Record(k, len(prompt), min(out, 16), 0.0))
            bodies.append(request_body(model, prompt, records[-1].asked))
        await asyncio.gather(*(complete(http, body, r, clock) for body, r in zip(bodies, records)))
    return records


# -- the summary ---------------------------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0–100) by linear interpolation between the sorted values (NumPy's default
    method); None for no values."""
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def spread(values: list[float], scale: float = 1.0) -> dict[str, float | None]:
    """p50, p90, p99, mean, min and max of ``values`` times ``scale`` (None each for no values)."""
    xs = [v * scale for v in values]
    return {"p50": percentile(xs, 50), "p90": percentile(xs, 90), "p99": percentile(xs, 99),
            "mean": statistics.fmean(xs) if xs else None, "min": min(xs, default=None), "max": max(xs, default=None),
            "count": len(xs)}


def ramp_end(records: list[Record], rows: int) -> float | None:
    """When the first ``rows`` requests to get a token had all got one (every slot decoding for the first time);
    None when fewer did."""
    firsts = sorted(r.times[0] for r in records if r.times)
    return firsts[rows - 1] if rows >= 1 and len(firsts) >= rows else None


def steady_window(wall: float, trim: float = 0.1, ramp: float | None = None,
                  cut: bool = False) -> tuple[float, float]:
    """The load phase without its ramp-up and its drain: from ``trim`` of the time in, or from ``ramp`` (see
    :func:`ramp_end`) when that is later, to ``trim`` of the time before the end, or to the end when the phase is
    ``cut`` at a duration (nothing drains then). Where the ramp leaves no time, the trimmed phase."""
    start, end = max(trim * wall, ramp or 0.0), wall if cut else (1 - trim) * wall
    return (start, end) if start < end else (trim * wall, (1 - trim) * wall)


def summarise(run: Run, rows: int | None = None, cut: bool = False) -> dict[str, Any]:
    """Counts, throughput and latency of one run: output tokens/s over the load phase's wall time (tokens read by
    its end: a cut request counts what it got), TTFT over the requests that got a token, TPOT over the requests
    done; over the :func:`steady_window` (after ``rows`` requests first decode together, to the end when the phase
    was ``cut`` at a duration): the output tokens/s, and the steady TPOT, the median over requests that did not
    fail of their TPOT within it."""
    records, wall = run.records, run.wall
    done = [r for r in records if r.done]
    failed = [r for r in records if r.error is not None and not r.cut]
    start, end = steady_window(wall, ramp=ramp_end(records, rows) if rows else None, cut=cut)
    steady = [t for r in records if r.error is None and (t := r.tpot_within(start, end)) is not None]
    output = sum(r.tokens_by(wall) for r in records)
    steady_output = sum(r.tokens_by(end) - r.tokens_by(start) for r in records)
    prefilled = sum(r.prompt_tokens for r in records if r.times and r.times[0] <= wall)
    return {"requests": {"sent": len(records), "done": len(done), "failed": len(failed),
                         "cut": sum(r.cut for r in records)},
            "errors": dict(Counter(r.error for r in failed).most_common(5)),
            "tokens_asked_done": sum(r.asked for r in done), "tokens_got_done": sum(r.tokens for r in done),
            "output_tokens": output, "prompt_tokens": prefilled, "wall_s": wall,
            "output_tokens_per_s": output / wall if wall > 0 else None,
            "prompt_tokens_per_s": prefilled / wall if wall > 0 else None,
            "ttft_ms": spread([r.ttft for r in records if r.times and r.times[0] <= wall], 1e3),
            "tpot_ms": spread([r.tpot for r in done if r.tpot is not None], 1e3),
            "steady_tpot_ms": percentile(steady, 50) * 1e3 if steady else None,
            "steady_window_s": [start, end], "steady_output_tokens_per_s": steady_output / (end - start),
            "latency_s": spread([r.ended - r.sent for r in done]), "client_lag_ms": spread(run.lags, 1e3)}


def server_load(samples: list[tuple[float, dict[str, float]]], window: tuple[float, float]) -> dict[str, Any]:
    """Per gauge of :data:`METRICS` sampled: its mean and max over the run and its mean in ``window``; per counter
    (:data:`COUNTERS`) its increase from the first sample to the last, per second, and its increase between the
    first and last samples in ``window``. From those, ``step_ms``: the engine's time per decode step in the window
    (decode seconds over decode steps: prefills between steps left out), and ``prefill_share``: the window's time
    the engine spent prefilling. None where the server did not report it."""
    out: dict[str, Any] = {"samples": len(samples)}
    for key in METRICS:
        seen = [(t, v[key]) for t, v in samples if key in v]
        inside = [(t, x) for t, x in seen if window[0] <= t <= window[1]]
        if not seen:
            out[key] = None
        elif key in COUNTERS:
            (t0, first), (t1, last) = seen[0], seen[-1]
            steady = inside[-1][1] - inside[0][1] if len(inside) >= 2 else None
            out[key] = {"increase": last - first, "per_s": (last - first) / (t1 - t0) if t1 > t0 else None,
                        "steady_increase": steady,
                        "steady_s": inside[-1][0] - inside[0][0] if steady is not None else None}
        else:
            inside = [x for _, x in inside]
            xs = [x for _, x in seen]
            out[key] = {"mean": statistics.fmean(xs), "max": max(xs),
                        "steady_mean": statistics.fmean(inside) if inside else None}

    def steady(key: str) -> float | None:
        return (out.get(key) or {}).get("steady_increase")

    seconds, steps, prefill = steady("decode_seconds"), steady("decode_steps"), steady("prefill_seconds")
    out["step_ms"] = 1e3 * seconds / steps if seconds is not None and steps else None
    span = (out.get("prefill_seconds") or {}).get("steady_s")
    out["prefill_share"] = prefill / span if prefill is not None and span else None
    return out


def live_batches(records: list[Record], wall: float, window: tuple[float, float],
                 ticks: int = 0) -> list[list[int]]:
    """At evenly spaced times in ``window`` (one a second, at least 10): the context of every request decoding
    then (its prompt and the tokens read so far)."""
    start, end = window
    n = ticks or max(10, int(end - start))
    times = [start + (end - start) * (k + 0.5) / n for k in range(n)]
    return [[r.prompt_tokens + r.tokens_by(t) for r in records if r.decoding_at(t, wall)] for t in times]
