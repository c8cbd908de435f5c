#!/usr/bin/env bash
# One device call that runs gpu_run.sh's stages by the card it got, each stage in its own
# folder, all returned as one tar (at most eight files come back from $OUT):
#
#   CALL=a SPLITSERVE_COMMIT=<hash> bash bench/gpu_call.sh "<H200 stages>" "<other stages>" [seconds]
#
# The first list runs on an H200, the second on anything else (calls naming nvidia-h200 have
# mostly started H100s). A stage is skipped when less time is left than it usually takes; the
# stages stop at [seconds] (default 560) so that the tar is written inside the call's limit.
# `apply:<patch>` as a stage runs `git apply <patch>` on the tree (an arm to measure before
# committing it); the stages after it run on the patched tree. Stage folders are
# /root/o/<CALL>-<n>-<stage>, kept while the machine stays warm, so give each call its own CALL.
set -uo pipefail
cd "$(dirname "$0")/.."
: "${CALL:?set CALL to a tag for this call}" "${SPLITSERVE_COMMIT:?set SPLITSERVE_COMMIT}"
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $card"
end=$((SECONDS + ${3:-560}))
if [[ $card == *H200* ]]; then stages=$1; else stages=$2; fi
# seconds each stage took on an H100, with a margin (tests did not finish in 560 s on a fresh one
# at 5f6175e; at 35bc58a tests-runner took 362 s on a fresh one, tests-kernels 268 s after it)
declare -A need=([bench-0.6b]=75 [bench-0.6b-triton]=75 [bench-0.6b-tfa4]=100 [bench-8b]=120
                 [bench-8b-tfa4]=150 [fa4-tests]=130 [smoke]=250 [tests]=550
                 [tests-runner]=400 [tests-kernels]=300 [decode-pages]=40)
n=0
for stage in $stages; do
  n=$((n + 1)); left=$((end - SECONDS))
  if [[ $stage == apply:* ]]; then
    git apply "${stage#apply:}" || { echo "not applied: the stages after it do not run"; break; }
    echo "applied ${stage#apply:}"; continue
  fi
  if [ "$left" -lt "${need[$stage]:-60}" ]; then echo "skip $stage ($left s left)"; continue; fi
  dir=/root/o/$CALL-$n-$stage; mkdir -p "$dir"
  echo "=== $stage $(date +%T) ($left s left)"
  SMOKE_TIMEOUT=$((left - 15)) OUT=$dir timeout $((left - 5)) bash bench/gpu_run.sh "$stage" > "$dir/log" 2>&1
  echo "rc $?"; grep -E "passed|failed|tok/s" "$dir/log" | tail -8
done
mkdir -p /root/o && tar -C /root/o -cf "${OUT:?}/r.tar" .
