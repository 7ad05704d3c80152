#!/bin/bash
# device call (session 17, issue 26, pdtail): where the added p99 of both PD modes comes from at 8 router processes on
# the 16-core host, and the opt-in connection even-out (`--placement-even-out`, balancer/service/processes/placement.py,
# rebalance) on vs off, by bench/pd_tail.py: per interleaved round the direct engine, `pdlb serve --processes 8` of this
# tree (row x8: the default, even-out off), the same with `--placement-even-out` (row x8eo), and x8 of f539070 (row
# x8@base, a git archive carried as a tarball; off = f539070's placement), each a 1 s warm-up, the
# 2.5 s latency window at 16 clients (router_overhead's) and a 2.5 s throughput window at 256 clients from 4 client
# processes (so each latency window starts from a saturated placement, as in b6); the probe on (per-request stage
# times, client connections per process, the placement's k changes and picks, GC pauses).
# Routers on CPUs 0-7, engines and clients on 8-15 (as b6). Run from the repo root with carry
# [".dev/device/whl6", ".dev/device/base_f539070.tgz"]; make the tarball with
#   git archive f539070 balancer pdlb_cli sim pyproject.toml | gzip > .dev/device/base_f539070.tgz   # ~1.5 MB
# Writes $OUT/b13.log (everything), $OUT/pd_tail.json, env.txt.
# Knobs (env): LIM (s, 190 in all), ROUNDS (3), MODES (vllm-pd,pd: the mode that missed in every repeat first), PY (python3), SKIP_PIP (1: use PY's own
#   packages, for a dry run elsewhere), RCPUS (0-7), MAXC (256), LOADP (4), PROCS (8).
# Expected on the 16-core host: ~15 s set-up, per mode ~10 s start + rounds of ~28 s; pd_tail.py's --budget-s skips
# rounds that would not fit (printed). Dry run on the 2-core host: see /work/notes/pdtail.md.
set -u -o pipefail
T0=$SECONDS; OUT=${OUT:-/tmp/pdtail_b13}; mkdir -p $OUT; PY=${PY:-python3}; LIM=${LIM:-190}
exec > >(tee $OUT/b13.log) 2>&1
if [ -z "${SKIP_PIP:-}" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .dev/device/whl6/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
{ date -u; nproc; uptime; $PY -VV; git log -1 --format=%H 2>/dev/null; } > $OUT/env.txt
cat $OUT/env.txt
BASE=()
if [ -f .dev/device/base_f539070.tgz ]; then
  mkdir -p /tmp/basef5 && tar -xzf .dev/device/base_f539070.tgz -C /tmp/basef5 && BASE=(--baseline /tmp/basef5)
else
  echo "no .dev/device/base_f539070.tgz: this tree only"
fi
BUDGET=$((LIM - (SECONDS - T0) - 15))
timeout $((BUDGET + 13)) $PY bench/pd_tail.py --modes ${MODES:-vllm-pd,pd} --rows "x8=--processes ${PROCS:-8}" \
  --rows "x8eo=--processes ${PROCS:-8} --placement-even-out" "${BASE[@]}" \
  --rounds ${ROUNDS:-3} --max-concurrency ${MAXC:-256} --load-processes ${LOADP:-4} --router-cpus ${RCPUS:-0-7} \
  --budget-s $BUDGET --out $OUT/pd_tail.json
echo "pdtail_b13.sh: rc $?, $((SECONDS - T0)) s"; uptime
