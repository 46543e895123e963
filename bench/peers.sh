#!/usr/bin/env bash
# Taskhoster (SQLite; PostgreSQL + Redis) beside three peers of the shared peer benchmark
# (beanstalkd -f0, Huey on SQLite, RQ with Redis's AOF), in one run. See bench/README.md.
#   usage: bench/peers.sh [ROUNDS]        (default ROUNDS=1)
#   env:   BENCH_N, BENCH_W, BENCH_RATE, BENCH_DUR, BENCH_BATCH, BENCH_PHASE_TIMEOUT
#            passed through to every peer (see ../shared/peers/common.py)
#          BENCH_OUT        results folder (default /tmp/peers-results-taskhoster; emptied first)
#          PEERS="taskhoster huey-sqlite"   a subset (names as in ALL below: beanstalkd-binlog-f0,
#            huey-sqlite, rq-simple-aof, taskhoster (SQLite), taskhoster-pg (PostgreSQL + Redis))
#          TASKHOSTER_PG_URL, TASKHOSTER_REDIS_URL  for taskhoster-pg (defaults: the local ones)
#          PEER_TIMEOUT     seconds per peer run before `timeout` stops it (default 1500)
#          TASKHOSTER_ARGS  more options for bench/peer_taskhoster.py (e.g. "--no-fsync")
#          PEERS_DIR        the shared benchmark (default ../shared/peers from the repository)
#          BENCH_IMAGE=ext4|xfs  run every peer on a fresh filesystem of that kind (ext4: with
#            its journal, as production runs it), made in a BENCH_IMAGE_MB (8192) MiB file
#            under BENCH_IMAGE_DIR (/var/tmp) and mounted through a loop device (root); it
#            becomes BENCH_DATA, and is unmounted and removed at the end
#          FLUSH_ROUNDS     rounds of bench/flushcost.py, run in the data dir (so on the
#            peers' filesystem) before and after the peers (default 200; 0: not run)
# Sets up what ../shared/peers/run_all.sh sets up (/tmp/peers-venv, beanstalkd, redis-server),
# then runs the peers interleaved (round 1: every peer, round 2: every peer, ...), each under
# `timeout -k 30`, and prints the shared report's table. Ctrl-C or SIGTERM stops the peer that
# is running (it cleans up and writes what it has) and prints the table so far.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
PEERS_DIR="$(cd "${PEERS_DIR:-$REPO/../shared/peers}" && pwd)"
export PEERS_VENV="${PEERS_VENV:-/tmp/peers-venv}"
PY="$PEERS_VENV/bin/python"
TPY="$REPO/.venv/bin/python"
ROUNDS="${1:-1}"
FLUSH_ROUNDS="${FLUSH_ROUNDS:-200}"
for pair in "ROUNDS=$ROUNDS" "FLUSH_ROUNDS=$FLUSH_ROUNDS"; do
  case "${pair#*=}" in
    '' | *[!0-9]*) echo "${pair%%=*} must be a whole number, not '${pair#*=}'" >&2; exit 2 ;;
  esac
done
PEER_TIMEOUT="${PEER_TIMEOUT:-1500}"
RES="${BENCH_OUT:-/tmp/peers-results-taskhoster}"
export BENCH_OUT="$RES"

# ---- setup (as run_all.sh, plus the project's venv) --------------------------------------
if [ ! -x "$PY" ]; then python3 -m venv "$PEERS_VENV"; fi
"$PY" -m pip install -q --disable-pip-version-check -r "$PEERS_DIR/requirements.txt"
if ! command -v redis-server >/dev/null || ! command -v beanstalkd >/dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server beanstalkd
fi
if [ ! -x "$TPY" ]; then (cd "$REPO" && source scripts/_venv.sh dev); fi

# ---- peers: name | command (run from $PEERS_DIR) ------------------------------------------
PG_URL="${TASKHOSTER_PG_URL:-postgres://postgres@127.0.0.1:5432/postgres}"
REDIS_URL_FOR_PG="${TASKHOSTER_REDIS_URL:-redis://127.0.0.1:6379/0}"
ALL=(
  "beanstalkd-binlog-f0|$PY beanstalk_bench.py binlog-f0"
  "huey-sqlite|$PY huey_bench.py sqlite"
  "rq-simple-aof|$PY rq_bench.py simple aof"
  "taskhoster|$TPY $REPO/bench/peer_taskhoster.py --peers-dir $PEERS_DIR ${TASKHOSTER_ARGS:-}"
  "taskhoster-pg|$TPY $REPO/bench/peer_taskhoster.py --peers-dir $PEERS_DIR --database-url $PG_URL --redis-url $REDIS_URL_FOR_PG ${TASKHOSTER_ARGS:-}"
)
SEL="${PEERS:-}"
mkdir -p "$RES"
rm -f "$RES"/*.json "$RES"/*.log "$RES"/flushcost-*.txt

# ---- the filesystem the peers run on ----------------------------------------------------
IMAGE=""
MOUNTED=""
unmount_image() {
  if [ -n "$MOUNTED" ]; then
    umount "$MOUNTED" 2>/dev/null || umount -l "$MOUNTED" 2>/dev/null || true
    rmdir "$MOUNTED" 2>/dev/null || true
  fi
  if [ -n "$IMAGE" ]; then rm -f "$IMAGE"; fi
  MOUNTED=""
  IMAGE=""
}
trap unmount_image EXIT
if [ -n "${BENCH_IMAGE:-}" ]; then
  case "$BENCH_IMAGE" in
    ext4) MKFS=(mkfs.ext4 -q -F) ;;
    xfs) MKFS=(mkfs.xfs -q -f) ;;
    *) echo "BENCH_IMAGE must be ext4 or xfs, not $BENCH_IMAGE" >&2; exit 2 ;;
  esac
  IMAGE_DIR="${BENCH_IMAGE_DIR:-/var/tmp}"
  IMAGE="$(mktemp -p "$IMAGE_DIR" "peers-$BENCH_IMAGE-XXXXXX.img")"
  truncate -s "${BENCH_IMAGE_MB:-8192}M" "$IMAGE"
  "${MKFS[@]}" "$IMAGE"
  MOUNTED="$(mktemp -d -p "$IMAGE_DIR" "peers-$BENCH_IMAGE-mnt-XXXXXX")"
  mount -o loop "$IMAGE" "$MOUNTED"
  export BENCH_DATA="$MOUNTED/peers-bench-data"
fi
DATA="${BENCH_DATA:-/tmp/peers-bench-data}"
mkdir -p "$DATA"

flushcost() { # the disk's own cost, on the peers' filesystem, in this run
  if [ "$FLUSH_ROUNDS" -gt 0 ]; then
    "$TPY" "$REPO/bench/flushcost.py" --tmpdir "$DATA" --rounds "$FLUSH_ROUNDS" \
      --group-sizes "" >"$RES/flushcost-$1.txt" 2>&1 || echo "flushcost ($1) failed" >&2
    sed -n '1,5p' "$RES/flushcost-$1.txt" >&2
  fi
}
{
  echo "date: $(date -u +%FT%TZ)"
  echo "host: $(nproc) cpus, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')"
  echo "mem:  $(free -m | awk '/Mem:/{print $2" MiB"}')"
  echo "kernel: $(uname -r); debian $(cat /etc/debian_version); $("$PY" -V)"
  echo "sqlite: $("$PY" -c 'import sqlite3;print(sqlite3.sqlite_version)')"
  echo "redis: $(redis-server --version | awk '{print $3}'); beanstalkd: $(beanstalkd -v | awk '{print $2}')"
  echo "taskhoster: $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo '?'); $("$TPY" -V)"
  echo "data dir: $DATA on $(df -T "$DATA" 2>/dev/null | awk 'NR==2{print $2}')${IMAGE:+ (an image on a loop device; $BENCH_IMAGE with its defaults)}"
  echo "rounds: $ROUNDS; N=${BENCH_N:-20000} W=${BENCH_W:-2}"
} | tee "$RES/machine.txt"

report() {
  echo
  "$PY" "$PEERS_DIR/report.py" "$RES" | tee "$RES/table.md"
  for when in before after; do
    if [ -f "$RES/flushcost-$when.txt" ]; then
      echo "the disk's own flush, $when the peers ($RES/flushcost-$when.txt):"
      sed -n '1,5p' "$RES/flushcost-$when.txt"
    fi
  done
}

CHILD=""
stop() {
  trap - INT TERM
  if [ -n "$CHILD" ]; then
    kill -TERM "$CHILD" 2>/dev/null || true # timeout passes it on to the peer
    wait "$CHILD" 2>/dev/null || true
  fi
  echo "stopped" >&2
  report
  unmount_image
  exit 130
}
trap stop INT TERM

flushcost before
cd "$PEERS_DIR"
for run in $(seq 1 "$ROUNDS"); do
  for entry in "${ALL[@]}"; do
    IFS='|' read -r name cmd <<<"$entry"
    if [ -n "$SEL" ] && [[ " $SEL " != *" $name "* ]]; then continue; fi
    echo "== $name run $run ($(date -u +%T))" >&2
    # shellcheck disable=SC2086
    env BENCH_RUN="$run" timeout -k 30 "$PEER_TIMEOUT" $cmd >>"$RES/$name.log" 2>&1 &
    CHILD=$!
    if ! wait "$CHILD"; then
      echo "   $name run $run FAILED (see $RES/$name.log)" >&2
    fi
    CHILD=""
  done
done

flushcost after
report
