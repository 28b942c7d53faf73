#!/usr/bin/env bash
# README command 1 in one sitting: this tree quiet, this tree with one core kept busy by a plain
# Python busy loop, and an earlier checkout (BEFORE=/path/to/worktree; 2026-12-02: 2e5738e, before
# issue 55) with the same loop. Usage: BEFORE=/tmp/base docs/measurements/issue55/busy_ab.sh
HERE=$(git rev-parse --show-toplevel)
. "$HERE/.venv/bin/activate"
run() {  # run NAME TREE BUSY
  local name=$1 tree=$2 busy=$3 pid=""
  rm -rf /tmp/ab_$name
  [ "$busy" = 1 ] && { python -c "while True: pass" & pid=$!; sleep 1; }
  cd $tree
  s=$(date +%s.%N)
  PYTHONPATH=$tree python experiments/bench.py --limit 1 --max-new-tokens 64 --output /tmp/ab_$name > /tmp/ab_$name.log 2>&1
  e=$(date +%s.%N)
  [ -n "$pid" ] && kill $pid
  echo "$name $(echo "$e - $s" | bc) s"
}
run quiet "$HERE" 0
run busy "$HERE" 1
run busy_before "$BEFORE" 1
run quiet2 "$HERE" 0
