"""Where does decode attention's fixed ~19 us over its bytes go (tile_fill-9406881.json)? Each
program of one launch stamps the global timer and its SM's cycle counter at its start, once its
first request is known, after its tile loop and at its end (`paged_decode_attention(trace=)`);
a one-program kernel stamps the timer just before and just after the launch in the same CUDA
graph. Per batch of tune_decode.py's shapes: the launch's span against its bytes at the copy
bandwidth, cut into launch latency, the spread of program starts, prologue, tile loop, merges,
the spread of program ends and the exit; and whether a program's loop time follows the keys
its range holds (unequal ranges would say: balance by keys, not tiles). Then whether the spread
of loop times is the SMs': each program's SM id, how well one replay's per-program loop times
predict the next's (the same ranges), and how well each SM's streaming rate (keys a us) in one
shape predicts its rate in another (different ranges, programs and requests). A steady per-SM
rate would let ranges be sized by SM; a random one leaves only dynamic balancing. Last, at 256
and 128 rows, whether the ranges' loop times follow the pages they read: the same contexts over
the same pages twice, then over other pages.

    PYTHONPATH=$PWD:$PWD/bench python3 bench/decode_timeline_probe.py $OUT/decode_timeline.json
"""

import json
import statistics
import sys

import torch
import triton
import triton.language as tl

import run_info
from kernels import capture_graph, copy_bandwidth, graph_us, kv_bytes
from tune_decode import SHAPES, problem

from dataplane.kernels.paged_decode_attention import (
    TRACE_COLUMNS, paged_decode_attention, plan_decode)

REPLAYS = 20
RESHUFFLE_ROWS = (256, 128)


@triton.jit
def _timer_kernel(out_ptr):
    t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [tl.program_id(0)],
                                  dtype=tl.int64, is_pure=False, pack=1)
    tl.store(out_ptr, t)


def range_bounds(plan, num_programs: int) -> list[int]:
    """The first tile of each program's range of one kv head, then the list's end (every head's
    ranges are the same: the kernel's equal cut of the tile list)."""
    total = int(plan.req_tile_start[-1])
    active = min(num_programs, total)
    return [p * total // active for p in range(active + 1)]


def range_sums(bounds: list[int], per_tile: torch.Tensor) -> list[int]:
    sums = per_tile[:bounds[-1]].long().cumsum(0).tolist()
    return [sums[hi - 1] - (sums[lo - 1] if lo else 0) for lo, hi in zip(bounds, bounds[1:])]


def program_keys(plan, num_programs: int) -> list[int]:
    """Valid keys in each program's range."""
    return range_sums(range_bounds(plan, num_programs), plan.tile_info & 0xFFFF)


def program_requests(plan, num_programs: int) -> list[int]:
    """Requests (whole or in part) in each program's range: the first tiles it holds, and one
    more where it begins inside a request."""
    bounds = range_bounds(plan, num_programs)
    firsts = (plan.tile_info >> 16) & 1
    return [n + 1 - int(firsts[lo]) for n, lo in zip(range_sums(bounds, firsts), bounds)]


def fit(loops: list[float], keys: list[int], requests: list[int]) -> dict:
    """Least squares loop_us = a + b * keys + c * requests over one kv head's ranges (every head
    walks the same ranges: the median over heads), with each regressor's correlation alone."""
    x = torch.tensor([[1.0, k, r] for k, r in zip(keys, requests)], dtype=torch.float64)
    y = torch.tensor(loops, dtype=torch.float64)
    coef = torch.linalg.lstsq(x, y[:, None]).solution.flatten().tolist()
    residual = (y - x @ torch.tensor(coef, dtype=torch.float64)).std().item()
    return dict(us=coef[0], us_per_key=coef[1], us_per_request=coef[2], residual_std_us=residual,
                spread_std_us=y.std().item(),
                keys_correlation=correlation(loops, keys),
                requests_correlation=correlation(loops, requests))


def correlation(xs: list[float], ys: list[float]) -> float | None:
    """Pearson's r, None where either side is constant."""
    if len(set(xs)) < 2 or len(set(ys)) < 2:
        return None
    return statistics.correlation([float(x) for x in xs], [float(y) for y in ys])


def timeline(trace: torch.Tensor, before: int, after: int, cycles_per_ns: float) -> dict:
    """One launch's phases in us; per-program phases from the cycle counter."""
    t = trace.tolist()
    active = [r for r in t if r[2]]
    starts, ends = [r[0] for r in t], [r[6] for r in t]
    med = lambda xs: statistics.median(xs) / cycles_per_ns / 1e3  # noqa: E731
    return dict(
        span_us=(after - before) / 1e3, launch_us=(min(starts) - before) / 1e3,
        start_spread_us=(max(starts) - min(starts)) / 1e3,
        prologue_us=med([r[3] - r[1] for r in active]), loop_us=med([r[5] - r[3] for r in active]),
        loop_min_us=min(r[5] - r[3] for r in active) / cycles_per_ns / 1e3,
        loop_max_us=max(r[5] - r[3] for r in active) / cycles_per_ns / 1e3,
        merges_us=med([r[7] - r[5] for r in active]),
        merges_max_us=max(r[7] - r[5] for r in active) / cycles_per_ns / 1e3,
        end_spread_us=(max(ends) - min(r[6] for r in active)) / 1e3,
        end_after_median_us=(max(ends) - statistics.median(r[6] for r in active)) / 1e3,
        exit_us=(after - max(ends)) / 1e3, loop_us_per_program=[
            (r[5] - r[3]) / cycles_per_ns / 1e3 for r in active])


def probe(model: str, rows: int, lo: int, hi: int, copy_bw: float) -> dict:
    args, contexts = problem(model, rows, lo, hi)
    plan = plan_decode(*args[:2], *args[3:5])
    out = paged_decode_attention(*args, plan=plan)  # resolves the program count untraced
    num_kv_heads = args[1].shape[2]
    trace = torch.zeros(num_kv_heads * plan.num_programs, TRACE_COLUMNS, dtype=torch.int64,
                        device=out.device)
    stamps = torch.zeros(2, dtype=torch.int64, device=out.device)

    def traced():
        _timer_kernel[(1,)](stamps[0:])
        paged_decode_attention(*args, plan=plan, out=out, trace=trace)
        _timer_kernel[(1,)](stamps[1:])

    plain_us = graph_us(lambda: [paged_decode_attention(*args, plan=plan, out=out)
                                 for _ in range(10)]) / 10
    traced_us = graph_us(lambda: [paged_decode_attention(*args, plan=plan, out=out, trace=trace)
                                  for _ in range(10)]) / 10
    graph = capture_graph(traced)
    runs, traces = [], []
    for _ in range(REPLAYS):
        trace.zero_()
        graph.replay()
        torch.cuda.synchronize()
        t = trace.tolist()
        traces.append(t)
        ns = sum(r[6] - r[0] for r in t)
        cycles_per_ns = sum(r[7] - r[1] for r in t) / ns if ns else 1.0
        runs.append(timeline(trace, *stamps.tolist(), cycles_per_ns) | dict(
            cycles_per_ns=cycles_per_ns))
    keys = program_keys(plan, plan.num_programs)
    requests = program_requests(plan, plan.num_programs)
    loop_runs = [r.pop("loop_us_per_program") for r in runs]
    loops = loop_runs[-1]
    # the median over replays and kv heads of each range's loop time
    per_range = [statistics.median(run[h * len(keys) + i] for run in loop_runs
                                   for h in range(len(run) // len(keys)))
                 for i in range(len(keys))]
    summary = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    ideal_us = kv_bytes(contexts) / copy_bw * 1e6
    return dict(model=model, rows=rows, contexts=[lo, hi], context_tokens=sum(contexts),
                num_programs=plan.num_programs, ideal_us=ideal_us, plain_us=plain_us,
                traced_us=traced_us, median=summary,
                keys_per_program=[min(keys), statistics.median(keys), max(keys)],
                loop_us_vs_keys=sorted(zip(keys, loops[:len(keys)]))[::max(1, len(keys) // 12)],
                loop_fit=fit(per_range, keys, requests) if len(keys) > 3 else None,
                per_range_loop_us=per_range,
                # one range's kv heads (the same pages, other 256-byte slices) against each other
                heads_spread_us=statistics.median(
                    max(ys) - min(ys) for i in range(len(keys))
                    if (ys := [loops[h * len(keys) + i] for h in range(len(loops) // len(keys))])),
                **by_sm(traces, loop_runs, keys, plan.num_programs))


def by_sm(traces: list[list[list[int]]], loop_runs: list[list[float]], keys: list[int],
          num_programs: int) -> dict:
    """Per replay, each active program's SM; whether they stay put; the correlation of
    per-program loop times between consecutive replays; and each SM's keys a us over all
    replays (for the correlation across shapes)."""
    active = [[r for r in t if r[2]] for t in traces]
    sms = [[r[8] for r in a] for a in active]
    same_sm = statistics.mean(a == b for x, y in zip(sms, sms[1:]) for a, b in zip(x, y))
    corr = [c for x, y in zip(loop_runs, loop_runs[1:]) if (c := correlation(x, y)) is not None]
    # records are kv_head * num_programs + prog; every kv head's ranges hold the same keys
    records = [i for i, r in enumerate(traces[0]) if r[2]]
    rate: dict[int, list[float]] = {}
    for run_sms, loop in zip(sms, loop_runs):
        for record, sm, us in zip(records, run_sms, loop):
            rate.setdefault(sm, []).append(keys[record % num_programs] / us)
    return dict(same_sm_fraction=same_sm,
                replay_loop_correlation=statistics.median(corr) if corr else None,
                keys_per_us_by_sm={sm: statistics.mean(v) for sm, v in sorted(rate.items())})


def across_shapes(report: dict) -> list[dict]:
    """For each pair of shapes: the correlation of the SMs' keys a us (the SMs both met)."""
    out = []
    shapes = report["shapes"]
    for a, b in zip(shapes, shapes[1:]):
        ra, rb = a["keys_per_us_by_sm"], b["keys_per_us_by_sm"]
        common = sorted(set(ra) & set(rb))
        out.append(dict(rows=[a["rows"], b["rows"]], sms=len(common), correlation=(
            correlation([ra[s] for s in common], [rb[s] for s in common])
            if len(common) > 2 else None)))
    return out


def main() -> None:
    torch.manual_seed(0)
    copy_bw = copy_bandwidth()
    report = dict(device=torch.cuda.get_device_name(), commit=run_info.commit(),
                  copy_bandwidth_gbps=copy_bw / 1e9, shapes=[])
    for model, rows, lo, hi in SHAPES:
        if model != "qwen3-0.6b":
            continue
        r = probe(model, rows, lo, hi, copy_bw)
        report["shapes"].append(r)
        m = r["median"]
        print(f"{rows:3d} rows: {r['plain_us']:6.1f} us in a graph ({r['traced_us']:6.1f} traced;"
              f" bytes {r['ideal_us']:6.1f}); span {m['span_us']:6.1f} = launch "
              f"{m['launch_us']:.1f} + start spread {m['start_spread_us']:.1f}; prologue "
              f"{m['prologue_us']:.1f}, loop {m['loop_us']:.1f} [{m['loop_min_us']:.1f}, "
              f"{m['loop_max_us']:.1f}], merges {m['merges_us']:.1f} (max "
              f"{m['merges_max_us']:.1f}); end spread {m['end_spread_us']:.1f} (after median "
              f"{m['end_after_median_us']:.1f}), exit {m['exit_us']:.1f}; keys/program "
              f"{r['keys_per_program']}; {m['cycles_per_ns']:.2f} cycles/ns; same SM between "
              f"replays {r['same_sm_fraction']:.2f}, loop times' replay correlation "
              f"{r['replay_loop_correlation']}; a range's heads spread {r['heads_spread_us']:.1f} us; "
              f"loop fit {r['loop_fit']}", flush=True)
        report["sm_rate_correlation_across_shapes"] = across_shapes(report)
        with open(sys.argv[1], "w") as f:
            json.dump(report, f, indent=1)
    for pair in report["sm_rate_correlation_across_shapes"]:
        print(f"SMs' keys/us, {pair['rows'][0]} against {pair['rows'][1]} rows: correlation "
              f"{pair['correlation']} over {pair['sms']} SMs", flush=True)
    report["reshuffled"] = [reshuffled(model, rows, lo, hi, copy_bw) for model, rows, lo, hi
                            in SHAPES if model == "qwen3-0.6b" and rows in RESHUFFLE_ROWS]
    with open(sys.argv[1], "w") as f:
        json.dump(report, f, indent=1)


def reshuffled(model: str, rows: int, lo: int, hi: int, copy_bw: float) -> dict:
    """The same contexts (so the same ranges) over the pages of three permutations, seeds 1, 1
    and 2: do a range's loop times follow its pages? The repeat of seed 1 is the control."""
    loops = []
    for seed in (1, 1, 2):
        torch.manual_seed(seed)
        loops.append(probe(model, rows, lo, hi, copy_bw)["per_range_loop_us"])
    result = dict(rows=rows, same_pages=correlation(loops[0], loops[1]),
                  other_pages=correlation(loops[0], loops[2]))
    print(f"{rows:3d} rows, ranges' loop times: r {result['same_pages']} over the same pages, "
          f"{result['other_pages']} over others", flush=True)
    return result


if __name__ == "__main__":
    main()
