"""The benchmark client's statistics (bench_metrics.py) against their documented definitions, by
hand and against brute-force versions of those definitions; and bench's summary table
(bench_report.py) showing the figures its columns name: P99s, the completed-token throughput
with the streamed one beside it for a run with failures, busy / idle ratios of TTFT, TPOT and the
streamed throughput, milliseconds below 10 to two decimals."""
from __future__ import annotations

import numpy as np
import pytest

from blink.client.bench_load import RequestRecord
from blink.client.bench_metrics import Slo, decode_gaps_ms, full_batch_gaps_ms, summarize
from blink.client.bench_report import interference_ratios, streamed_throughput, summary_table


def rec(sent, times, error=None):
    return RequestRecord(10, len(times), sent, list(times), error)


def test_goodput_takes_tpot_over_n_minus_one_gaps():
    # three tokens 100 ms apart: TPOT = 200 ms / 2 = 100 ms (not 200 / 3 = 66.7)
    slow = rec(0.0, [0.1, 0.2, 0.3])
    m = summarize([slow], wall_s=1.0, slo=Slo(tpot_ms=80))
    assert m["tpot_ms"]["p50"] == pytest.approx(100.0)
    assert m["goodput"] == 0.0  # 100 ms > 80 ms: missed
    assert summarize([slow], wall_s=1.0, slo=Slo(tpot_ms=120))["goodput"] == 1.0


def test_an_slo_met_exactly_is_met():
    # exact binary fractions: TTFT 125 ms, TPOT 125 ms, both at their SLO ("within", as vLLM)
    exact = rec(0.0, [0.125, 0.25, 0.375])
    m = summarize([exact], wall_s=1.0, slo=Slo(ttft_ms=125.0, tpot_ms=125.0))
    assert m["ttft_ms"]["p50"] == 125.0 and m["tpot_ms"]["p50"] == 125.0
    assert m["goodput"] == 1.0


def brute_decode_gaps(records):
    """The definition: every inter-token gap of a completed request that no request's prefill
    interval (send, first token) overlaps (open intervals: touching is no overlap)."""
    prefills = [(r.sent, r.token_times[0]) for r in records if r.token_times]
    out = []
    for r in records:
        if r.error is not None or len(r.token_times) < 2:
            continue
        for s, e in zip(r.token_times, r.token_times[1:]):
            if not any(b < e and f > s for b, f in prefills):
                out.append((e - s) * 1e3)
    return out


def test_a_prefill_inside_another_still_holds_the_gaps_it_spans():
    a = rec(0.0, [0.5, 0.6])          # prefill 0 - 500 ms
    b = rec(0.1, [0.2, 0.21])         # prefill 100 - 200 ms, inside A's
    c = rec(-1.0, [-0.9, 0.3, 0.4, 0.55, 0.62])  # decoding since before both
    # C's gaps -900..300, 300..400 and 400..550 overlap A's prefill (0 - 500 ms), and so does
    # B's 200..210; C's 550..620 and A's own 500..600 are clear
    want = brute_decode_gaps([a, b, c])
    assert sorted(want) == pytest.approx([70.0, 100.0])
    assert sorted(decode_gaps_ms([a, b, c])) == pytest.approx(sorted(want))


def test_a_request_cut_after_its_first_token_still_prefilled():
    # the cut request's prompt was prefilled (sent 150 ms, first token 250 ms): A's gap from
    # 100 to 300 ms held it ("a request that failed before its first token counts no prefill")
    a = rec(0.0, [0.1, 0.3, 0.31])
    cut = rec(0.15, [0.25], error="cut by the run time limit (1 s)")
    assert decode_gaps_ms([a, cut]) == pytest.approx([10.0])
    m = summarize([a, cut], wall_s=1.0)
    assert m["decode_gaps"] == 1 and m["decode_tpot_ms"] == pytest.approx(10.0)


def test_decode_and_full_batch_gaps_against_their_definitions_at_random():
    rng = np.random.default_rng(7)
    for trial in range(30):
        records = []
        for _ in range(int(rng.integers(2, 9))):
            sent = float(rng.uniform(0, 1))
            first = sent + float(rng.uniform(0.01, 0.3))
            times = [first]
            for _ in range(int(rng.integers(0, 8))):
                # some tokens arrive in one chunk (a gap of zero)
                times.append(times[-1] + (0.0 if rng.random() < 0.2
                                          else float(rng.uniform(0.005, 0.1))))
            error = "cut" if rng.random() < 0.15 else None
            records.append(rec(sent, times, error))
        want = brute_decode_gaps(records)
        np.testing.assert_allclose(np.sort(decode_gaps_ms(records)), np.sort(want))
        done = [r for r in records if r.error is None and len(r.token_times) > 1]
        for streams in (1, 2, 3):
            full = [(e - s) * 1e3 for r in done
                    for s, e in zip(r.token_times, r.token_times[1:])
                    if sum(q.token_times[0] <= s and q.token_times[-1] >= e
                           for q in done) >= streams]
            np.testing.assert_allclose(np.sort(full_batch_gaps_ms(records, streams)),
                                       np.sort(full))


def test_one_runs_failures_withhold_the_latency_ratios():
    """A busy run with failed requests beside a whole idle run (or the other way) has no latency
    ratio: only a pair of whole runs gives one."""
    def run(interference, failed, ttft):
        return {"system": "blink", "rate": 4.0, "repeat": 0, "interference": interference,
                "metrics": {"failed": failed, "ttft_ms": {"p99": ttft},
                            "tpot_ms": {"p99": 8.0}, "streamed_throughput": 100.0,
                            "output_throughput": 90.0}}
    for idle_failed, busy_failed in ((0, 3), (3, 0)):
        (x,) = interference_ratios([run("idle", idle_failed, 100.0),
                                    run("busy", busy_failed, 300.0)])
        assert x["ttft_p99"] is None and x["tpot_p99"] is None
        assert x["output_throughput"] == 1.0


def report_run(interference, rate, failed, ttft, tpot, output, streamed):
    return {"system": "blink", "interference": interference, "rate": rate, "repeat": 0,
            "client": {"saturated": False},
            "metrics": {"request_throughput": 3.5, "output_throughput": output,
                        "streamed_throughput": streamed, "failed": failed, "goodput": None,
                        "ttft_ms": {"p50": ttft[0], "p90": ttft[1], "p99": ttft[2]},
                        "tpot_ms": {"p50": tpot[0], "p90": tpot[1], "p99": tpot[2]},
                        "itl_ms": {"p50": 7.0, "p90": 11.0, "p99": 12.0},
                        "e2e_ms": {"p50": 1000.0, "p90": 2000.0, "p99": 2400.0}}}


def test_summary_table_columns():
    runs = [report_run("idle", 4.0, 0, (120.0, 300.0, 480.0), (8.25, 9.0, 9.5), 900.0, 900.0),
            report_run("busy", 4.0, 0, (200.0, 700.0, 960.0), (9.0, 12.0, 13.3), 700.0, 720.0),
            report_run("idle", "inf", 2, (150.0, 400.0, 600.0), (8.5, 9.0, 9.75), 1200.0, 1500.0)]
    doc = {"runs": runs, "interference": interference_ratios(runs)}
    lines = summary_table(doc).splitlines()
    cells = [[c.strip(" |") for c in line.split(" | ")] for line in lines
             if line.startswith("| blink | idle") or line.startswith("| blink | busy")]
    idle, busy, failed = cells[0], cells[1], cells[2]
    assert idle[4:12] == ["3.50", "900", "120.0 / 480.0", "8.25 / 9.50", "12.0", "2400.0", "",
                          "0"]
    assert busy[6:8] == ["200.0 / 960.0", "9.00 / 13.3"]
    # a run with failures: the completed-token rate, and the streamed one it says beside it
    assert failed[5] == "1,200 (streamed 1,500)" and failed[11] == "2"
    # busy / idle: TTFT P99 960 / 480, TPOT P99 13.3 / 9.5, streamed tokens/s 720 / 900
    (ratio,) = [[c.strip(" |") for c in line.split(" | ")] for line in lines
                if line.startswith("| blink | 4.0 |")]
    assert ratio[3:6] == ["2.00", "1.40", "0.80"]


def test_streamed_throughput_is_the_streamed_rate_where_recorded():
    assert streamed_throughput({"streamed_throughput": 1500.0, "output_throughput": 1200.0}) \
        == 1500.0
    # a file written before the field: the completed rate
    assert streamed_throughput({"output_throughput": 1200.0}) == 1200.0
    (x,) = interference_ratios([
        dict(report_run("idle", 4.0, 1, (1, 1, 1), (1, 1, 1), 100.0, 400.0)),
        dict(report_run("busy", 4.0, 1, (1, 1, 1), (1, 1, 1), 100.0, 200.0))])
    assert x["output_throughput"] == pytest.approx(0.5)
