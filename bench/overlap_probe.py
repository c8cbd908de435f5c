"""Does a decode step run faster as two half-batches on two streams (NanoFlow's overlap)?

At 129-256 rows a Qwen3-0.6B decode layer spends ~150 us in attention, bound by the KV cache's
bytes, and ~40 us in GEMMs and small kernels that stream 31 MB of weights at a third of the
copy bandwidth (latency-bound). Cut the batch in two: while one half attends, the other half
runs its GEMMs, and the two halves' attention launches alternate (each waits for the other
half's before it), so attention keeps the memory busy and the GEMMs hide under it. Both halves
read the weights, and each attention launch leaves SMs to the other half's GEMMs only if it
does not hold them all, so the attention's programs per SM is swept too.

CUDA graphs of 28 layers with distinct weights and the LM head (decode_layer_probe.Layers, the
layer as it runs: our GEMMs and PDL where the shipped routing picks them for the half's rows),
per batch size of uniform 640-key contexts:

- one: the step as it runs today, one stream;
- two: the halves on two streams, attention launches alternating;
- free: the halves on two streams with no order between them;
- with --programs P...: one and two with decode attention at P programs per SM.

Microseconds a step. `python3 bench/overlap_probe.py $OUT/overlap.json [--programs 1 2]`
(PYTHONPATH: the repo and bench/).

Result on the H200 (overlap-c0959b2.json, best of three interleaved rounds): two streams lost at
every size, 256 rows 6.23 ms against 5.74, 128 rows 3.74 against 3.43; with no order between the
halves 5.94 and 3.74. Decode attention holds every SM it can (2 programs an SM, the default), so
the other half's GEMMs wait for it, and each half pays the whole chain's fixed costs and reads
the weights again. At 1 program an SM the halves nearly paid for themselves at 128 rows (4.13
against 4.12 ms), but a step with that attention is 20-26% slower (4.12 against 3.43 ms).
"""

import argparse
import json
from collections.abc import Iterator

import torch
import torch.nn.functional as F

import run_info
from decode_layer_probe import HEADS, HEAD_DIM, HIDDEN, KV_HEADS, LAYERS, Layers, randn, \
    routed_qkv
from kernels import graph_us

from dataplane.kernels.paged_decode_attention import paged_decode_attention, plan_decode
from dataplane.kernels.qk_norm_rope import qk_norm_rope_store

VOCAB = 151936
ROWS = [256, 192, 160, 128]
CONTEXT = 640
ROUNDS = 3


def layers_of(L: Layers, lm_head: torch.Tensor, rows: slice,
              num_programs: int | None) -> Iterator[None]:
    """The step's 28 layers and LM head for L's `rows`, pausing just before and just after
    each attention launch (the driver orders the launches across streams there)."""
    plan = plan_decode(L.q_like[rows], L.k_cache, L.block_tables[rows], L.seq_lens[rows],
                       num_programs=num_programs)
    hidden, residual = L.x[rows], L.residual[rows].clone()
    for i in range(LAYERS):
        hidden, residual = L.norm(hidden, residual)
        q, k, v = routed_qkv(hidden, L.qkv[i]).split(
            [HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], -1)
        q = qk_norm_rope_store(
            L.positions[rows], q.view(-1, HEADS, HEAD_DIM),
            k.view(-1, KV_HEADS, HEAD_DIM), v.view(-1, KV_HEADS, HEAD_DIM), L.head_norm,
            L.head_norm, 1e-6, L.cos_sin, L.k_cache, L.v_cache, L.slots[rows])
        yield
        attn = paged_decode_attention(q, L.k_cache, L.v_cache, L.block_tables[rows],
                                      L.seq_lens[rows], HEAD_DIM ** -0.5, plan=plan)
        yield
        hidden, residual = L.norm(L.row_parallel(attn.flatten(1), L.o[i]), residual)
        hidden = L.row_parallel(L.routed_gate_up(hidden, L.gate_up[i]), L.down[i])
    hidden = L.norm(hidden, residual)[0]
    F.linear(hidden, lm_head)


def step(L: Layers, lm_head: torch.Tensor, side: torch.cuda.Stream, halves: bool,
         alternate: bool, num_programs: int | None) -> None:
    """halves: two streams; alternate: each attention launch waits for the other half's last."""
    first = torch.cuda.current_stream()
    if not halves:
        for _ in layers_of(L, lm_head, slice(0, L.rows), num_programs):
            pass
        return
    side.wait_stream(first)
    half = L.rows // 2
    parts = [(layers_of(L, lm_head, slice(0, half), num_programs), first),
             (layers_of(L, lm_head, slice(half, L.rows), num_programs), side)]

    def resume(gen: Iterator[None], stream: torch.cuda.Stream) -> None:
        with torch.cuda.stream(stream):
            next(gen, None)

    last: torch.cuda.Event | None = None
    for gen, stream in parts:
        resume(gen, stream)  # up to layer 0's attention
    for _ in range(LAYERS):
        for gen, stream in parts:
            if alternate and last is not None:
                stream.wait_event(last)
            resume(gen, stream)  # the attention launch
            last = torch.cuda.Event()
            last.record(stream)
            resume(gen, stream)  # up to the next layer's attention, or to the end
    first.wait_stream(side)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--programs", type=int, nargs="*", default=[],
                        help="decode attention programs per SM to try besides the default")
    args = parser.parse_args()
    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    lm_head = randn(VOCAB, HIDDEN, scale=HIDDEN ** -0.5)
    side = torch.cuda.Stream()
    report = dict(device=torch.cuda.get_device_name(), commit=run_info.commit(),
                  context=CONTEXT, shapes=[])
    for rows in ROWS:
        L = Layers(rows, CONTEXT)
        arms = [("one", False, False, None), ("two", True, True, None), ("free", True, False, None)]
        for per_sm in args.programs:
            num_programs = -(-sms * per_sm // KV_HEADS)
            arms += [(f"one_p{per_sm}", False, False, num_programs),
                     (f"two_p{per_sm}", True, True, num_programs)]
        result: dict[str, list] = {name: [] for name, *_ in arms}
        for _ in range(ROUNDS):  # interleaved: a slow spell of the machine hits every arm
            for name, halves, alternate, num_programs in arms:
                try:
                    result[name].append(graph_us(lambda: step(
                        L, lm_head, side, halves, alternate, num_programs)))
                except Exception as e:  # noqa: BLE001 - a failed capture is a result
                    result[name].append(f"{type(e).__name__}: {e}"[:300])
        report["shapes"].append(dict(rows=rows, step_us=result))
        print(f"{rows:3d} rows, us a step: " + "; ".join(
            f"{k} " + " ".join(f"{v:.1f}" if isinstance(v, float) else str(v) for v in runs)
            for k, runs in result.items()), flush=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
