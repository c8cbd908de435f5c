"""A/B of workload A in-process on one machine: this tree's versions of some files (arm B)
against other versions of them (one arm per directory), alternating B, A, ... each round.

Whole runs of workload A spread by ~1% from machine to machine and ~0.5% on one machine, more
than most changes are worth, and each run's decode buckets move together on a machine; so arms
compare on one machine, interleaved, by bucket. Each directory mirrors the repository's paths:

    mkdir -p ab_old/dataplane/kernels
    git show 22df033:dataplane/kernels/splitk_matmul.py > ab_old/dataplane/kernels/splitk_matmul.py
    python3 bench/ab.py ab_old --rounds 2 --out $OUT/ab.json    # on the GPU machine

(an untracked directory travels with the working tree to the device machine; delete it after).
Every run is `bench/throughput.py --modes inprocess` with the arm's files in place; the tree's
files are put back at the end. Prints and saves, per run: tok/s, the fraction of the roofline,
the copy bandwidth and the decode buckets' ms a step.
"""

import argparse
import json
import pathlib
import shutil
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
RUN_TIMEOUT_S = 300  # a 0.6B run takes ~30 s on the H200, an 8B one ~70


def arm_files(arm_dirs: list[pathlib.Path]) -> dict[str, dict[str, pathlib.Path]]:
    """arm name -> {repository path -> the arm's version}; B, the tree, holds every path any other
    arm replaces (saved to a temporary directory, so that the arms can overwrite the tree)."""
    arms = {d.name: {str(f.relative_to(d)): f for f in sorted(d.rglob("*")) if f.is_file()}
            for d in arm_dirs}
    assert "B" not in arms and len(arms) == len(arm_dirs), "arm directories need distinct names"
    saved = pathlib.Path(tempfile.mkdtemp(prefix="ab-tree-"))
    tree = {}
    for path in sorted({p for files in arms.values() for p in files}):
        assert (ROOT / path).is_file(), f"{path} is not a file of this tree"
        (saved / path).parent.mkdir(parents=True, exist_ok=True)
        tree[path] = pathlib.Path(shutil.copy2(ROOT / path, saved / path))
    return {"B": tree} | arms


def put(files: dict[str, pathlib.Path]) -> None:
    for path, source in files.items():
        shutil.copyfile(source, ROOT / path)


def summary(result: dict) -> dict:
    buckets = result["device_time"]["buckets"]
    return dict(tok_per_s=result["output_tok_per_s"], fraction=result["fraction_of_roofline"],
                seconds=result["seconds"], copy_GBps=result["copy_bandwidth_GBps"],
                device_s_by_kind=result["device_time"]["device_s_by_kind"],
                buckets={k: dict(steps=v["steps"], ms=v["busy_ms"]) for k, v in buckets.items()})


def bucket_order(name: str) -> tuple[bool, int]:
    """Decode buckets by their row bound, then the prompt steps ("mixed")."""
    kind, _, rows = name.partition(" ")
    return kind != "decode", int(rows or 0)


def report(run: str, r: dict) -> None:
    if "error" in r:
        print(f"{run}: failed: {r['error'][-300:]}", flush=True)
        return
    buckets = sorted(r["buckets"].items(), key=lambda kv: bucket_order(kv[0]))
    print(f"{run}: {r['tok_per_s']:,.0f} tok/s, {r['fraction']:.2%} at {r['copy_GBps']:,.0f} GB/s; "
          "ms a step: " + " ".join(f"{k.split()[-1]} {v['ms']:.3f}" for k, v in buckets),
          flush=True)


def measure(args: argparse.Namespace, out_dir: pathlib.Path) -> dict:
    """One in-process run of workload A with the files now in place: its summary, or its error."""
    try:
        done = subprocess.run(
            [sys.executable, args.throughput, "--model", args.model, "--modes", "inprocess",
             "--out-dir", str(out_dir)], cwd=ROOT, capture_output=True, text=True,
            timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return dict(error=f"no result after {RUN_TIMEOUT_S} s")
    found = sorted(out_dir.glob("*.json"))
    if done.returncode or not found:
        return dict(error=(done.stdout + done.stderr)[-2000:])
    return summary(json.loads(found[0].read_text()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("arms", nargs="+", type=pathlib.Path,
                        help="directories of other versions, one arm each (named by the directory)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--throughput", default=str(ROOT / "bench" / "throughput.py"),
                        help=argparse.SUPPRESS)  # a stand-in, to try this script off a GPU
    args = parser.parse_args()
    arms = arm_files(args.arms)
    work = pathlib.Path(tempfile.mkdtemp(prefix="ab-runs-"))
    runs: dict[str, dict] = {}
    try:
        for i in range(1, args.rounds + 1):
            for name, files in arms.items():
                put(arms["B"])
                put(files)
                run = f"{name}{i}"
                runs[run] = measure(args, work / run)
                report(run, runs[run])
                args.out.write_text(json.dumps(dict(arms={k: sorted(v) for k, v in arms.items()},
                                                    runs=runs), indent=1))
    finally:
        put(arms["B"])


if __name__ == "__main__":
    main()
