#!/usr/bin/env bash
# Set up the development environment (.venv) and run the demo or the tests.
#
#   scripts/dev.sh demo [PROMPT]   set up, start both planes on CPU (default tiny model) and stream
#                                  a completion through the gRPC client
#   scripts/dev.sh test [ARGS]     set up and run the test suite (ARGS go to pytest)
#   scripts/dev.sh setup           set up only
#
# On machines without an NVIDIA GPU, torch comes from constraints/cpu.txt (a CPU build); GPU
# machines get whatever torch pip resolves.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${SPLITSERVE_VENV:-.venv}

find_python() {
  for candidate in python3.12 python3.11 python3.13 python3; do
    if command -v "$candidate" >/dev/null 2>&1 &&
       "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
      echo "$candidate"; return
    fi
  done
  echo "splitserve needs Python >= 3.11" >&2; exit 1
}

setup() {
  [ -x "$VENV/bin/python" ] || "$(find_python)" -m venv "$VENV"
  local stamp="$VENV/.splitserve-installed" want
  want=$(cat pyproject.toml constraints/cpu.txt | sha256sum | cut -d' ' -f1)
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then return; fi
  local constraint=()
  if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    constraint=(-c constraints/cpu.txt)
  fi
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q "${constraint[@]}" -e ".[dataplane,test]"
  echo "$want" > "$stamp"
}

demo() {
  local prompt=${1:-"The quick brown fox"} port log pid
  port=$("$VENV/bin/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  log=$(mktemp)
  "$VENV/bin/splitserve" serve --port "$port" --num-kv-blocks 512 >"$log" 2>&1 &
  pid=$!
  # expanded now: the locals are gone when the EXIT trap runs
  trap "kill $pid 2>/dev/null; wait $pid 2>/dev/null; rm -f '$log'" EXIT
  echo "splitserve serve started (pid $pid, gRPC on 127.0.0.1:$port); streaming a completion:" >&2
  if ! "$VENV/bin/splitserve" generate --address "127.0.0.1:$port" --wait 120 \
       --max-tokens 32 --temperature 0 "$prompt"; then
    echo "--- server log ---" >&2; cat "$log" >&2; exit 1
  fi
}

cmd=${1:-}
shift || true
case "$cmd" in
  setup) setup ;;
  demo) setup; demo "$@" ;;
  test)
    setup
    set +e
    "$VENV/bin/python" -m pytest "$@"
    code=$?
    # pytest exits 5 when it collected no tests: that is a failure here, not a pass.
    [ $code -eq 5 ] && echo "no tests were collected" >&2
    exit $code ;;
  *) sed -n '2,10p' "$0" >&2; exit 2 ;;
esac
