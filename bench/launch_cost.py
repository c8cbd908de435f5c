"""The Triton attention backend's own Python a layer, with Triton's launches stubbed out (no GPU
needed, Triton importable): what a forward's 28 layers cost the host in our launchers, apart
from Triton's `JITFunction.run` and the compiled kernel's launcher, which the layers after a
step's first call directly (`host_profile.py --timers` clocks all of it on a GPU).

Cases, Qwen3-0.6B's heads (16 query, 8 kv, head_dim 128), 16-token pages:
- mixed, graph pieces: 15 decodes and a 512-token prompt, every layer attending from the same
  q/out buffers (MixedGraphs.run, between a prompt step's graph pieces);
- mixed, eager: the same step, a new q and out a layer (prompt steps the graphs do not take);
- decode, eager: 64 decodes, a new q a layer (--enforce-eager).
Then what Triton's JITFunction.run spends on each launch binding the arguments and looking the
compiled kernel up, which the layers after a step's first skip.

    PYTHONPATH=<triton> python bench/launch_cost.py [--repeat 200]
"""

import argparse
import pathlib
import sys
import time

import torch
from triton.backends.compiler import BaseBackend
from triton.compiler import CompiledKernel
from triton.runtime.jit import JITFunction, create_function_from_signature

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import dataplane.kernels.paged_decode_attention as decode_module  # noqa: E402
import dataplane.kernels.paged_prefill_attention as prefill_module  # noqa: E402
from dataplane.attention.triton_backend import TritonAttention  # noqa: E402
from dataplane.forward_context import ForwardContext  # noqa: E402

NUM_LAYERS, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 28, 16, 8, 128, 16


class _NoRun(CompiledKernel):
    """Stands in for a compiled kernel: `kernel[grid](...)` reads the three grid sizes, as
    Triton 3.6's launcher does, and nothing more."""

    def __init__(self) -> None:  # CompiledKernel's own takes a compiled binary
        pass

    def __getitem__(self, grid):
        return lambda *args: (grid[0], grid[1], grid[2])


class _NoLaunch:
    """Stands in for a @triton.jit kernel: `kernel[grid](...)` records its arguments, does
    nothing and returns a compiled kernel that does nothing either (what PagedLaunch launches
    directly after a step's first layer)."""

    def __init__(self, jit: JITFunction) -> None:
        self.jit = jit
        self.signature = jit.signature
        self.last_call: tuple[tuple, dict] | None = None

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.last_call = (args, kwargs)
            return _NoRun()
        return launch


def _stub_kernels() -> dict[str, _NoLaunch]:
    stubs = {}
    for module, name in [(decode_module, "_decode_kernel"), (decode_module, "_plan_kernel"),
                         (prefill_module, "_prefill_kernel")]:
        stubs[name] = _NoLaunch(getattr(module, name))
        setattr(module, name, stubs[name])
    decode_module._programs_per_head = lambda *args, **kwargs: 3
    return stubs


def binding_us(kernel: _NoLaunch, repeat: int) -> float:
    """What Triton 3.6's JITFunction.run does at every launch that a direct launch skips, for
    the kernel's last call: binding and specializing its arguments (its binder, here with the
    base backend's specialization) and looking its cache key up. The median over `repeat`."""
    binder = create_function_from_signature(kernel.jit.signature, kernel.jit.params, BaseBackend)
    args, kwargs = kernel.last_call
    key_cache: dict = {}
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        _, specialization, options = binder(*args, **kwargs)
        key_cache.get((tuple(specialization), str(options)))
        times.append(time.perf_counter() - start)
    return 1e6 * sorted(times)[len(times) // 2]


def _context(query_lens: list[int], seq_lens: list[int]) -> ForwardContext:
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    i32 = dict(dtype=torch.int32)
    return ForwardContext(
        query_start_loc=torch.tensor(starts, **i32), seq_lens=torch.tensor(seq_lens, **i32),
        slot_mapping=torch.arange(starts[-1]), block_tables=torch.zeros(len(seq_lens), 64, **i32),
        logits_indices=torch.tensor(starts[1:]) - 1, max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), query_start_loc_host=starts, seq_lens_host=seq_lens)


def us_a_layer(query_lens: list[int], seq_lens: list[int], shared: bool, repeat: int) -> float:
    """The median over `repeat` forwards of one forward's attention Python, a layer."""
    backend = TritonAttention()
    num_tokens = sum(query_lens)
    k_cache = torch.zeros(1000, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    qs = [torch.zeros(num_tokens, NUM_HEADS, HEAD_DIM, dtype=torch.bfloat16)
          for _ in range(1 if shared else NUM_LAYERS)]
    out = torch.zeros_like(qs[0]) if shared else None
    times = []
    for _ in range(repeat):
        ctx = _context(query_lens, seq_lens)
        start = time.perf_counter()
        for layer in range(NUM_LAYERS):
            if layer == 0:
                ctx.attention_plan = None  # what the first attention layer does
            backend.forward(qs[0 if shared else layer], k_cache, v_cache, ctx, 0.1, out=out)
        times.append((time.perf_counter() - start) / NUM_LAYERS)
    return 1e6 * sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()
    stubs = _stub_kernels()
    mixed = ([1] * 15 + [512], [300] * 15 + [512])
    for name, lens, shared in [("decode, eager", ([1] * 64, [300] * 64), False),
                               ("mixed, eager", mixed, False),
                               ("mixed, graph pieces", mixed, True)]:
        print(f"{name}: {us_a_layer(*lens, shared, args.repeat):.1f} us a layer", flush=True)
    print("Triton's binding and cache key a launch, which a direct launch skips (the mixed step): "
          + ", ".join(f"{name} {binding_us(stubs[name], 10 * args.repeat):.1f} us"
                      for name in ("_decode_kernel", "_prefill_kernel")))


if __name__ == "__main__":
    main()
