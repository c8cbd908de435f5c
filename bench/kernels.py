"""Micro-benchmark of the attention and elementwise kernels on Qwen3-0.6B / Qwen3-8B head shapes
(bf16, head_dim 128, 8 kv heads; 16 or 32 q heads), against their torch references and, when
flash_attn.cute imports, FlashAttention-4 (paged, page size 128).

Times are triton.testing.do_bench medians (L2 flushed before each call, as a layer's KV would
be). Bandwidth = bytes that must move / time, compared with this device's measured copy
bandwidth; prefill also reports TFLOP/s (causal FLOPs). A case that fails is recorded with its
error and the run goes on.

    PYTHONPATH=. python3 bench/kernels.py --out bench/results/kernels.json [--sweep] [--no-fa4]

--sweep also times a small grid of decode/prefill tile configs and decode program counts on a few
shapes (the defaults live in dataplane/kernels/paged_*_attention.py `_config`).
"""

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
import triton
from triton.testing import do_bench

import run_info

from dataplane.kernels.paged_decode_attention import (paged_decode_attention,
                                                      paged_decode_attention_ref, plan_decode)
from dataplane.kernels.paged_prefill_attention import (paged_prefill_attention,
                                                       paged_prefill_attention_ref)
from dataplane.kernels.rmsnorm import fused_add_rms_norm, rms_norm_ref
from dataplane.kernels.qk_norm_rope import qk_norm_rope_store, qk_norm_rope_store_ref
from dataplane.kernels.silu_and_mul import silu_and_mul, silu_and_mul_ref
from dataplane.kernels.store_kv import store_kv, store_kv_ref

DTYPE = torch.bfloat16
DEVICE = "cuda"
HEAD_DIM, NUM_KV_HEADS, BLOCK = 128, 8, 16
MODELS = {"qwen3-0.6b": 16, "qwen3-8b": 32}  # q heads; hidden 1024 / 4096
HIDDEN = {"qwen3-0.6b": (1024, 3072), "qwen3-8b": (4096, 12288)}  # (hidden, intermediate)
DECODE_BATCHES = [1, 4, 16, 64, 256]
DECODE_CONTEXTS = [128, 1024, 4096, 8192]
# (name, new tokens per request, cached tokens per request)
PREFILL_CASES = [
    ("2 prompts x 1024", [1024] * 2, [0] * 2),
    ("8 prompts x 1024", [1024] * 8, [0] * 8),
    ("1 prompt x 8192", [8192], [0]),
    ("4 chunks x 512 after 3000 cached", [512] * 4, [3000] * 4),
    ("prompt 2048 + 255 decodes at 512", [2048] + [1] * 255, [0] + [511] * 255),
]
ELEMENTWISE_TOKENS = [1, 64, 256, 4096]
SWEEP_DECODE_SHAPES = [("qwen3-0.6b", 256, 1024), ("qwen3-8b", 64, 4096), ("qwen3-0.6b", 1, 8192),
                       ("qwen3-8b", 16, 4096)]  # (model, batch, context)
SWEEP_PREFILL_CASES = [("qwen3-0.6b", 1), ("qwen3-8b", 3)]  # (model, index in PREFILL_CASES)
REF_TOKEN_LIMIT = 1 << 17  # the torch references loop over requests: time them on small cases only


def bench_ms(fn: Callable[[], object], rep: int = 60) -> float:
    return do_bench(fn, warmup=10, rep=rep, return_mode="median")


def capture_graph(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """fn captured as a CUDA graph, after two eager calls (compiles, allocator warm-up)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def graph_us(fn: Callable[[], object], repeats: int = 20) -> float:
    """Mean microseconds of one fn() call, replaying a graph of it: how a step runs its kernels,
    without the host's launch time that do_bench's eager calls include."""
    graph = capture_graph(fn)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / repeats


def copy_bandwidth() -> float:
    """Device-to-device copy of 1 GiB: bytes read + written per second."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    return 2 * src.numel() / (bench_ms(lambda: dst.copy_(src)) * 1e-3)


def load_fa4() -> tuple[Callable | None, str]:
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except ImportError as e:
        return None, f"absent ({e})"
    return flash_attn_varlen_func, "found"


def paged_problem(query_lens: list[int], cached_lens: list[int], num_heads: int,
                  block_size: int, shuffled: bool = True) -> dict:
    """Random bf16 cache with the blocks shuffled over the requests (not shuffled: each
    request's blocks adjacent, in order); everything on the GPU."""
    seq_lens = [q + c for q, c in zip(query_lens, cached_lens)]
    blocks_per_req = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_req) + 1
    kv = torch.randn(2, num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE)
    order = (torch.randperm(num_blocks, device=DEVICE) if shuffled
             else torch.arange(num_blocks, device=DEVICE)).int()
    tables = torch.zeros(len(seq_lens), max(blocks_per_req), dtype=torch.int32, device=DEVICE)
    used = 0
    for i, count in enumerate(blocks_per_req):
        tables[i, :count] = order[used:used + count]
        used += count
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    return dict(q=torch.randn(starts[-1], num_heads, HEAD_DIM, dtype=DTYPE, device=DEVICE),
                k_cache=kv[0], v_cache=kv[1], block_tables=tables,
                query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
                max_query_len=max(query_lens), max_seq_len=max(seq_lens))


def prefill_args(p: dict) -> tuple:
    """paged_prefill_attention's positional arguments for a paged_problem."""
    return (p["q"], p["k_cache"], p["v_cache"], p["block_tables"], p["query_start_loc"],
            p["seq_lens"], HEAD_DIM ** -0.5)


def kv_bytes(seq_lens: list[int]) -> int:
    return 2 * sum(seq_lens) * NUM_KV_HEADS * HEAD_DIM * DTYPE.itemsize


def fa4_call(fa4: Callable, query_lens: list[int], cached_lens: list[int],
             num_heads: int, block_size: int = 128) -> Callable[[], object]:
    """One FA4 call on these shapes, run once (compiled). On Hopper, 128-token pages are FA4's
    TMA path; other sizes, its cp.async path (a page looked up per key row)."""
    p = paged_problem(query_lens, cached_lens, num_heads, block_size)
    run = lambda: fa4(p["q"], p["k_cache"], p["v_cache"],  # noqa: E731
                      cu_seqlens_q=p["query_start_loc"], max_seqlen_q=p["max_query_len"],
                      seqused_k=p["seq_lens"], max_seqlen_k=p["max_seq_len"],
                      page_table=p["block_tables"], softmax_scale=HEAD_DIM ** -0.5, causal=True)
    run()
    return run


def fa4_ms(fa4: Callable | None, query_lens: list[int], cached_lens: list[int],
           num_heads: int) -> float | str | None:
    """FA4 on the same shapes with its 128-token pages; an error comes back as its text."""
    if fa4 is None:
        return None
    try:
        return bench_ms(fa4_call(fa4, query_lens, cached_lens, num_heads))
    except Exception as e:  # noqa: BLE001 - a failing FA4 case is a result, not a crash
        return f"{type(e).__name__}: {e}"[:300]


def decode_case(model: str, batch: int, context: int, fa4: Callable | None, copy_bw: float) -> dict:
    num_heads = MODELS[model]
    p = paged_problem([1] * batch, [context - 1] * batch, num_heads, BLOCK)
    args = (p["q"], p["k_cache"], p["v_cache"], p["block_tables"], p["seq_lens"],
            HEAD_DIM ** -0.5)
    plan = plan_decode(*args[:2], *args[3:5])
    out = paged_decode_attention(*args, plan=plan)
    ms = bench_ms(lambda: paged_decode_attention(*args, plan=plan))
    moved = kv_bytes([context] * batch) + 2 * p["q"].numel() * DTYPE.itemsize
    row = dict(kernel="decode_attention", model=model, batch=batch, context=context,
               num_programs=plan.num_programs, ms=ms, gb_moved=moved / 1e9, gbps=moved / ms / 1e6,
               fraction_of_copy_bw=moved / (ms * 1e-3) / copy_bw)
    if batch * context <= REF_TOKEN_LIMIT:
        ref = paged_decode_attention_ref(*args)
        row["max_abs_error"] = (out.float() - ref.float()).abs().max().item()
        row["ref_ms"] = bench_ms(lambda: paged_decode_attention_ref(*args), rep=30)
    row["fa4_ms"] = fa4_ms(fa4, [1] * batch, [context - 1] * batch, num_heads)
    return row


def prefill_flops(query_lens: list[int], cached_lens: list[int], num_heads: int) -> float:
    keys_seen = sum(q * c + q * (q + 1) / 2 for q, c in zip(query_lens, cached_lens))
    return 4 * num_heads * HEAD_DIM * keys_seen  # QK^T and PV, a multiply-add each


def prefill_case(model: str, name: str, query_lens: list[int], cached_lens: list[int],
                 fa4: Callable | None, copy_bw: float) -> dict:
    num_heads = MODELS[model]
    p = paged_problem(query_lens, cached_lens, num_heads, BLOCK)
    args = prefill_args(p)
    out = paged_prefill_attention(*args, max_query_len=p["max_query_len"])
    ms = bench_ms(lambda: paged_prefill_attention(*args, max_query_len=p["max_query_len"]))
    seq_lens = [q + c for q, c in zip(query_lens, cached_lens)]
    moved = kv_bytes(seq_lens) + 2 * p["q"].numel() * DTYPE.itemsize
    flops = prefill_flops(query_lens, cached_lens, num_heads)
    row = dict(kernel="prefill_attention", model=model, case=name, num_tokens=sum(query_lens),
               ms=ms, tflops=flops / ms / 1e9, gbps=moved / ms / 1e6,
               fraction_of_copy_bw=moved / (ms * 1e-3) / copy_bw)
    if sum(seq_lens) <= REF_TOKEN_LIMIT and len(seq_lens) <= 16:
        ref = paged_prefill_attention_ref(*args)
        row["max_abs_error"] = (out.float() - ref.float()).abs().max().item()
        row["ref_ms"] = bench_ms(lambda: paged_prefill_attention_ref(*args), rep=30)
    row["fa4_ms"] = fa4_ms(fa4, query_lens, cached_lens, num_heads)
    return row


def elementwise_cases(model: str, num_tokens: int) -> list[tuple[str, Callable, Callable, int]]:
    """(name, kernel call, torch call, bytes moved) for the fusions at this token count."""
    hidden, inter = HIDDEN[model]
    num_heads, e = MODELS[model], DTYPE.itemsize
    x = torch.randn(num_tokens, hidden, dtype=DTYPE, device=DEVICE)
    res = torch.randn_like(x)
    w = torch.randn(hidden, dtype=DTYPE, device=DEVICE)
    gate_up = torch.randn(num_tokens, 2 * inter, dtype=DTYPE, device=DEVICE)
    qkv = torch.randn(num_tokens, (num_heads + 2 * NUM_KV_HEADS) * HEAD_DIM, dtype=DTYPE,
                      device=DEVICE)
    q = qkv[:, :num_heads * HEAD_DIM].view(num_tokens, num_heads, HEAD_DIM)
    k = qkv[:, num_heads * HEAD_DIM:(num_heads + NUM_KV_HEADS) * HEAD_DIM].view(
        num_tokens, NUM_KV_HEADS, HEAD_DIM)
    head_w = torch.randn(HEAD_DIM, dtype=DTYPE, device=DEVICE)
    cos_sin = torch.randn(8192, HEAD_DIM, device=DEVICE)
    positions = torch.randint(0, 8192, (num_tokens,), device=DEVICE)
    cache = torch.zeros(2, num_tokens + 16, BLOCK, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE,
                        device=DEVICE)
    slots = torch.randperm(num_tokens * BLOCK, device=DEVICE)[:num_tokens]
    qk_bytes = 2 * num_tokens * (num_heads + NUM_KV_HEADS) * HEAD_DIM * e
    return [
        ("add_rms_norm", lambda: fused_add_rms_norm(x, res, w, 1e-6),
         lambda: rms_norm_ref(x, w, 1e-6, res), 4 * x.numel() * e),
        ("silu_and_mul", lambda: silu_and_mul(gate_up), lambda: silu_and_mul_ref(gate_up),
         3 * num_tokens * inter * e),
        ("qk_norm_rope_store",
         lambda: qk_norm_rope_store(positions, q, k, k, head_w, head_w, 1e-6, cos_sin, cache[0],
                                    cache[1], slots),
         lambda: qk_norm_rope_store_ref(positions, q, k, k, head_w, head_w, 1e-6, cos_sin,
                                        cache[0], cache[1], slots), qk_bytes + 2 * k.numel() * e),
        ("store_kv", lambda: store_kv(k, k, cache[0], cache[1], slots),
         lambda: store_kv_ref(k, k, cache[0], cache[1], slots), 4 * k.numel() * e),
    ]


def elementwise_rows(model: str, num_tokens: int, copy_bw: float) -> list[dict]:
    rows = []
    for name, kernel, reference, moved in elementwise_cases(model, num_tokens):
        ms, ref_ms = bench_ms(kernel), bench_ms(reference)
        rows.append(dict(kernel=name, model=model, num_tokens=num_tokens, ms=ms, ref_ms=ref_ms,
                         speedup_vs_torch=ref_ms / ms, gbps=moved / ms / 1e6,
                         fraction_of_copy_bw=moved / (ms * 1e-3) / copy_bw))
    return rows


def sweep_rows(copy_bw: float) -> list[dict]:
    """Decode tiles and program counts, prefill tiles, on a few shapes; each config a row."""
    rows = []
    for model, batch, context in SWEEP_DECODE_SHAPES:
        p = paged_problem([1] * batch, [context - 1] * batch, MODELS[model], BLOCK)
        args = (p["q"], p["k_cache"], p["v_cache"], p["block_tables"], p["seq_lens"],
                HEAD_DIM ** -0.5)
        moved = kv_bytes([context] * batch)
        configs = [dict(num_warps=w, num_stages=s) for w in (4, 8) for s in (2, 3, 4)]
        for block_n in (32, 64, 128):
            for programs in (8, 16, 32, 64, None):
                for config in configs if programs is None else [{}]:
                    # a plan per config: a default plan keeps the count its first launch picks
                    plan = plan_decode(*args[:2], *args[3:5], num_programs=programs,
                                       block_n=block_n)
                    rows.append(measure_config("decode_attention", dict(
                        model=model, batch=batch, context=context, num_programs=programs,
                        config=config | dict(BLOCK_N=block_n)),
                        lambda: paged_decode_attention(*args, plan=plan, config=config), moved,
                        copy_bw))
    for model, case in SWEEP_PREFILL_CASES:
        name, query_lens, cached_lens = PREFILL_CASES[case]
        p = paged_problem(query_lens, cached_lens, MODELS[model], BLOCK)
        args = prefill_args(p)
        group = MODELS[model] // NUM_KV_HEADS
        flops = prefill_flops(query_lens, cached_lens, MODELS[model])
        for rows_m in (64, 128):
            for n, w, s in [(32, 4, 3), (64, 4, 3), (64, 8, 2), (64, 8, 3), (128, 8, 2)]:
                config = dict(BLOCK_Q=rows_m // group, BLOCK_N=n, num_warps=w, num_stages=s)
                row = measure_config("prefill_attention", dict(model=model, case=name,
                                                               config=config),
                                     lambda: paged_prefill_attention(
                                         *args, max_query_len=p["max_query_len"], config=config),
                                     kv_bytes([q + c for q, c in zip(query_lens, cached_lens)]),
                                     copy_bw)
                if "ms" in row:
                    row["tflops"] = flops / row["ms"] / 1e9
                rows.append(row)
    return rows


def measure_config(kernel: str, fields: dict, fn: Callable, moved: int, copy_bw: float) -> dict:
    row = dict(kernel=kernel, sweep=True, **fields)
    try:
        fn()
        ms = bench_ms(fn, rep=30)
        row.update(ms=ms, gbps=moved / ms / 1e6, fraction_of_copy_bw=moved / (ms * 1e-3) / copy_bw)
    except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: record, go on
        row["error"] = f"{type(e).__name__}: {e}"[:300]
    return row


def run_guarded(label: str, fn: Callable[[], dict | list[dict]], results: list[dict]) -> None:
    """One case: its rows, or a row with its error; never raises."""
    try:
        out = fn()
        rows = out if isinstance(out, list) else [out]
        torch.cuda.empty_cache()
    except Exception as e:  # noqa: BLE001 - one failing kernel must not end the run
        rows = [dict(case=label, error=f"{type(e).__name__}: {e}"[:500])]
    for row in rows:
        results.append(row)
        print(format_row(row), flush=True)


def format_row(row: dict) -> str:
    what = " ".join(str(row[k]) for k in ("kernel", "model", "case", "batch", "context",
                                          "num_tokens", "num_programs", "config") if k in row)
    if "error" in row:
        return f"{what:70s} ERROR {row['error']}"
    fa4 = row.get("fa4_ms")
    fa4_text = f" fa4 {fa4:8.3f} ms" if isinstance(fa4, float) else (" fa4 error" if fa4 else "")
    ref = f" torch {row['ref_ms']:8.3f} ms" if "ref_ms" in row else ""
    tflops = f" {row['tflops']:6.1f} TF/s" if "tflops" in row else ""
    return (f"{what:70s} {row['ms']:8.4f} ms {row['gbps']:7.0f} GB/s "
            f"({100 * row['fraction_of_copy_bw']:5.1f}% copy){tflops}{ref}{fa4_text}")


def summary(results: list[dict]) -> dict:
    """Geometric mean of ours / FA4 time per attention kernel (< 1: ours faster)."""
    out = {}
    for kernel in ("decode_attention", "prefill_attention"):
        ratios = [r["ms"] / r["fa4_ms"] for r in results if r.get("kernel") == kernel
                  and not r.get("sweep") and isinstance(r.get("fa4_ms"), float) and "ms" in r]
        if ratios:
            out[f"{kernel}_triton_over_fa4_geomean"] = statistics.geometric_mean(ratios)
    return out


def cases(fa4: Callable | None, copy_bw: float, sweep: bool) -> list[tuple[str, Callable]]:
    """(label, run) in order of importance: decode first, then the fusions, prefill, the sweep."""
    out = [(f"decode {m} {b}x{c}", partial(decode_case, m, b, c, fa4, copy_bw))
           for m in MODELS for b in DECODE_BATCHES for c in DECODE_CONTEXTS]
    out += [(f"elementwise {m} {n}", partial(elementwise_rows, m, n, copy_bw))
            for m in MODELS for n in ELEMENTWISE_TOKENS]
    out += [(f"prefill {m} {name}", partial(prefill_case, m, name, q, c, fa4, copy_bw))
            for m in MODELS for name, q, c in PREFILL_CASES]
    return out + ([("sweep", partial(sweep_rows, copy_bw))] if sweep else [])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON path, rewritten after each case")
    parser.add_argument("--sweep", action="store_true", help="also sweep tile configs")
    parser.add_argument("--no-fa4", action="store_true", help="skip FlashAttention-4")
    args = parser.parse_args()
    torch.manual_seed(0)
    started = time.time()
    copy_bw = copy_bandwidth()
    fa4, fa4_status = (None, "skipped") if args.no_fa4 else load_fa4()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {copy_bw / 1e9:.0f} GB/s; "
          f"FA4 {fa4_status}", flush=True)
    report = dict(device=torch.cuda.get_device_name(), commit=run_info.commit(),
                  torch=torch.__version__, triton=triton.__version__, dtype=str(DTYPE),
                  block_size=BLOCK, copy_bandwidth_gbps=copy_bw / 1e9, fa4=fa4_status)
    results: list[dict] = []
    for label, run in cases(fa4, copy_bw, args.sweep):
        run_guarded(label, run, results)
        report.update(seconds=time.time() - started, summary=summary(results), results=results)
        with open(args.out, "w") as f:  # a run cut short by a timeout keeps what it measured
            json.dump(report, f, indent=1)
    print(json.dumps(report["summary"]), f"done in {report['seconds']:.0f} s -> {args.out}")


if __name__ == "__main__":
    main()
