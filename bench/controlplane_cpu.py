"""The control plane's CPU time per step with many streams, on any machine: `splitserve serve`
on CPU with the small default model, N requests streamed at once through the gRPC client, and
the CPU seconds per step of the control plane's engine process and of its gRPC front-end from
GetLoad. The data plane's speed does not
matter here (it is another process); this is the cost that paces split mode on a fast GPU.

    python bench/controlplane_cpu.py --num-requests 256 --max-tokens 200
"""

import argparse
import asyncio
import json
import pathlib
import random
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from splitserve.client import AsyncClient, Client  # noqa: E402
from served import figures, sampled, serve, spy_summary  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--stream-interval", type=int, default=1)
    parser.add_argument("--frontends", type=int, default=1, help="serve's --frontends")
    parser.add_argument("--out", type=pathlib.Path)
    parser.add_argument("--spy", type=pathlib.Path, metavar="RAW",
                        help="sample the server's processes with py-spy (on PATH) during the run "
                             "into RAW; the JSON gets their busiest functions")
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randint(1, 500) for _ in range(rng.randint(8, 32))]
               for _ in range(args.num_requests)]
    log = pathlib.Path(tempfile.mkdtemp()) / "serve.log"

    async def send_all(address):
        async with AsyncClient(address) as client:
            return await asyncio.gather(*(client.generate(p, max_tokens=args.max_tokens,
                                                          temperature=0.6, ignore_eos=True)
                                          for p in prompts))
    with serve(["--max-num-seqs", str(args.num_requests), "--max-waiting-requests", "4096",
                "--stream-interval", str(args.stream_interval),
                "--frontends", str(args.frontends)], log, timeout=120) as served:
        with Client(served.address) as client:
            before = client.load()
            with sampled(served.pid, args.spy):
                start = time.perf_counter()
                done = asyncio.run(send_all(served.address))
                seconds = time.perf_counter() - start
            after = client.load()
    result = {
        "num_requests": args.num_requests, "max_tokens": args.max_tokens,
        "stream_interval": args.stream_interval, "frontends": args.frontends,
        "seconds": seconds, **figures(before, after, done),
        **({"py_spy": spy_summary(args.spy)} if args.spy else {})}
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
