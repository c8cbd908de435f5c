"""Does decode attention get faster with more programs resident per SM? Workload-like batch of
256 requests (tune_decode.py's), a few tile sizes and warp counts; for each, how many programs
one SM holds (as the launcher reads it from the compiled kernel) and the kernel's time.

    PYTHONPATH=.:bench python3 bench/residency_probe.py

On the H200 (seventh session, tree aa3de71 with its per-key-slot plan; printed, not saved): 2-6
resident programs an SM took 162.5-181.0 us, the best (64-key tiles, 2 warps, 4 an SM) 1.6%
under the default's 165.2.
"""

from kernels import bench_ms
from tune_decode import problem

from dataplane.kernels import paged_decode_attention as pda

# (BLOCK_N, num_warps, num_stages)
CONFIGS = [(128, 4, 2), (64, 4, 2), (64, 4, 3), (64, 2, 2), (32, 4, 2), (32, 2, 3)]


def main() -> None:
    args, _ = problem("qwen3-0.6b", 256, 100, 1100)
    q, k_cache, _, tables, lens, _ = args
    for block_n, warps, stages in CONFIGS:
        pda._resident_per_sm.clear()  # the launcher's cache: one entry after this config's run
        plan = pda.plan_decode(q, k_cache, tables, lens, block_n=block_n)
        config = dict(num_warps=warps, num_stages=stages)
        run = lambda: pda.paged_decode_attention(*args, plan=plan, config=config)  # noqa: E731
        run()
        (resident,) = pda._resident_per_sm.values()
        print(f"BLOCK_N {block_n}, {warps} warps, {stages} stages: {resident} resident per SM, "
              f"{bench_ms(run) * 1e3:.1f} us", flush=True)


if __name__ == "__main__":
    main()
