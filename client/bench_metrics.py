"""The benchmark's numbers from the client's records (bench_load.RequestRecord).

Per request: TTFT = first token - sent; TPOT = (last token - first token) / (tokens - 1);
end-to-end latency = last token - sent. ITL: every gap between consecutive chunks of a
request's stream, as in vLLM's benchmark (tokens that arrive in one chunk are one arrival and
add no gap; at a token a chunk this is the gap between tokens). Each is summarised as mean,
P50, P90 and P99 in milliseconds (NumPy's linear interpolation, as vLLM's). A request's tokens
are those its stream carried, which bench_load.stream_request checks against its final's
usage (a mismatch fails the request). Decode TPOT: the mean of the gaps during which no
prompt of the run was being prefilled (no request lay between its send and its first token):
where streams arrive together, TPOT and ITL also hold the steps that prefilled
the later streams' prompts while the first ones decoded; this is the decode steps' own time
as the client sees it (a request that failed before its first token counts no prefill).
Throughput is over the run's wall time (first send to last token): completed requests,
generated tokens, and prompt + generated tokens per second. Streamed throughput counts every
generated token the client received, also those of requests that failed or were cut by the
run's time limit: for a peer too slow to finish a workload within the limit, it is the rate it
streamed at, where the completed-token rate counts only the few requests that happened to
finish. Goodput: requests per second that met every stated SLO (TTFT and/or TPOT).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from blink.client.bench_load import RequestRecord

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class Slo:
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def met(self, ttft_ms: float, tpot_ms: float | None) -> bool:
        return ((self.ttft_ms is None or ttft_ms <= self.ttft_ms)
                and (self.tpot_ms is None or tpot_ms is None or tpot_ms <= self.tpot_ms))

    def to_json(self) -> dict:
        return {"ttft_ms": self.ttft_ms, "tpot_ms": self.tpot_ms}


def distribution(values_ms) -> dict:
    """mean, p50, p90, p99 (linear interpolation) of the values; None each when empty."""
    v = np.asarray(values_ms, np.float64)
    if v.size == 0:
        return {"mean": None, **{f"p{q}": None for q in PERCENTILES}}
    return {"mean": float(v.mean()),
            **{f"p{q}": float(np.percentile(v, q)) for q in PERCENTILES}}


def _token_gaps(records: list[RequestRecord]):
    """The completed requests of two tokens or more and the starts and ends (s) of their
    inter-token gaps, request after request; None when there are none."""
    done = [r for r in records if r.error is None and r.tokens > 1]
    if not done:
        return None
    return (done, np.concatenate([r.token_times[:-1] for r in done]),
            np.concatenate([r.token_times[1:] for r in done]))


def decode_gaps_ms(records: list[RequestRecord]) -> np.ndarray:
    """The inter-token gaps (ms) of the requests that completed, those that no request's
    prefill interval (its send to its first token) overlaps."""
    gaps = _token_gaps(records)
    if gaps is None:
        return np.zeros(0)
    _, starts, ends = gaps
    prefills = sorted((r.sent, r.token_times[0]) for r in records if r.token_times)
    union: list[list[float]] = []  # the prefill intervals merged, in order
    for begin, end in prefills:
        if union and begin < union[-1][1]:  # intervals that only touch stay apart
            union[-1][1] = max(union[-1][1], end)
        else:
            union.append([begin, end])
    begins, finishes = np.array(union).T
    # the first merged interval that ends after the gap starts overlaps it if it begins
    # before the gap ends
    i = np.searchsorted(finishes, starts, side="right")
    overlaps = (i < len(union)) & (begins[np.minimum(i, len(union) - 1)] < ends)
    return (ends - starts)[~overlaps] * 1e3


def full_batch_gaps_ms(records: list[RequestRecord], streams: int) -> np.ndarray:
    """The inter-token gaps (ms) of the completed requests during which at least `streams`
    requests were all decoding: each past its first token and not past its last. In a
    closed-loop run of `streams` concurrent requests that is the state a decode floor at batch
    `streams` describes: no prompt being prefilled (every request in flight decodes) and no
    stream finished yet. Where the streams arrive together, the first ones finish while the
    last still decode (they got their tokens of the prefill steps first): those gaps are of a
    smaller batch and are left out."""
    gaps = _token_gaps(records)
    if gaps is None:
        return np.zeros(0)
    done, starts, ends = gaps
    first = np.array([r.token_times[0] for r in done])
    last = np.array([r.token_times[-1] for r in done])
    # for each gap, the requests whose decoding [first token, last token] spans all of it,
    # counted a slice of gaps at a time (about 4M comparisons: 512 requests of 256 tokens are
    # 130k gaps)
    full = np.empty(len(starts), bool)
    step = max(1, (1 << 22) // len(done))
    for i in range(0, len(starts), step):
        s, e = starts[i:i + step, None], ends[i:i + step, None]
        full[i:i + step] = ((first <= s) & (last >= e)).sum(1) >= streams
    return (ends - starts)[full] * 1e3


def summarize(records: list[RequestRecord], wall_s: float, slo: Slo = Slo()) -> dict:
    """The run's metrics (the `metrics` object of the JSON schema in bench_report)."""
    done = [r for r in records if r.error is None and r.token_times]
    ttft = [(r.token_times[0] - r.sent) * 1e3 for r in done]
    tpot = [(r.token_times[-1] - r.token_times[0]) / (r.tokens - 1) * 1e3
            for r in done if r.tokens > 1]
    # a chunk's tokens share its arrival time: only the gaps between chunks
    itl = [float(g) * 1e3 for r in done for g in np.diff(r.token_times) if g > 0]
    e2e = [(r.token_times[-1] - r.sent) * 1e3 for r in done]
    output_tokens = sum(r.tokens for r in done)
    streamed_tokens = sum(r.tokens for r in records)
    prompt_tokens = sum(r.prompt_len for r in done)
    good = sum(slo.met((r.token_times[0] - r.sent) * 1e3,
                       (r.token_times[-1] - r.token_times[0]) / (r.tokens - 1) * 1e3
                       if r.tokens > 1 else None) for r in done)
    decode_gaps = decode_gaps_ms(records)
    wall = max(wall_s, 1e-9)
    return {
        "requests": len(records), "completed": len(done),
        "failed": len(records) - len(done),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "short_outputs": sum(r.tokens < r.output_len for r in done),
        "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
        "cached_prompt_tokens": sum(r.cached_prompt_tokens for r in done),
        "streamed_tokens": streamed_tokens,
        "wall_s": wall_s,
        "request_throughput": len(done) / wall,
        "output_throughput": output_tokens / wall,
        "streamed_throughput": streamed_tokens / wall,
        "total_token_throughput": (prompt_tokens + output_tokens) / wall,
        "goodput": good / wall if (slo.ttft_ms or slo.tpot_ms) else None,
        "ttft_ms": distribution(ttft), "tpot_ms": distribution(tpot),
        "itl_ms": distribution(itl), "e2e_ms": distribution(e2e),
        "decode_tpot_ms": float(decode_gaps.mean()) if decode_gaps.size else None,
        "decode_gaps": int(decode_gaps.size),
    }
