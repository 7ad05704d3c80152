#!/bin/bash
# device call (session 14, issue 26, procs): what each extra router process costs per request at the SAME offered load
# (bench/router_processes_rate.py: every pdlb serve --processes N runs at once, each driven in turn at a fixed rate,
# open loop), N = 1 and 8, this tree against the session start's (a git archive of 389e2e6 carried as a tarball),
# routers on CPUs 0-7, engines + 4 client processes on 8-15. Answers: at equal load, how much more CPU per request
# do 8 under-loaded processes pay than 1, and how much of that this tree removed.
# Run from the repo root with carry [".dev/device/whl6", ".dev/device/base_389e2e6.tgz"] (make the tarball with
#   git archive 389e2e6 balancer pdlb_cli sim | gzip > .dev/device/base_389e2e6.tgz   # 1.4 MB)
# Writes $OUT/rate.log and $OUT/rate.json. Knobs (env): LIM (s, 200), RATE (req/s, 1200), DUR (s per window, 3),
#   ROUNDS (2), PROCS (1,8), MODES (pd,regular,vllm-pd), RCPUS (0-7), NOBASE (1: skip the session-start rows),
#   LOADP (client processes, 4), PY (python3), SKIP_PIP (1: use PY's own packages; for a dry run elsewhere).
# Expected on the 16-core host: ~50 s per mode (4 routers: x1, x8, x1@base, x8@base; 2 rounds of 4 windows of ~5 s),
# ~160 s in all. Dry run on the 2-core host (SKIP_PIP=1 PY=.venv/bin/python RCPUS=0 LOADP=1 RATE=100 DUR=1 ROUNDS=1): see
# /work/notes/procs.md (2 modes: rc 0 in 158 s there).
set -u -o pipefail
T0=$SECONDS; OUT=${OUT:-/tmp/procs_rate}; mkdir -p $OUT; PY=${PY:-python3}
if [ -z "${SKIP_PIP:-}" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .dev/device/whl6/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
BASE=()
if [ -z "${NOBASE:-}" ] && [ -f .dev/device/base_389e2e6.tgz ]; then
  mkdir -p /tmp/base389 && tar -xzf .dev/device/base_389e2e6.tgz -C /tmp/base389 && BASE=(--baseline /tmp/base389)
fi
nproc; uptime; $PY -VV
timeout ${LIM:-200} $PY bench/router_processes_rate.py --modes ${MODES:-pd,regular,vllm-pd} --processes ${PROCS:-1,8} \
  --rate ${RATE:-1200} --connections 256 --load-processes ${LOADP:-4} --engines 4 --pd-engines 2 --duration-s ${DUR:-3} \
  --rounds ${ROUNDS:-2} --idle-s 2 --router-cpus ${RCPUS:-0-7} "${BASE[@]}" --out $OUT/rate.json 2>&1 | tee $OUT/rate.log
echo "procs_rate.sh: rc $?, $((SECONDS - T0)) s"; uptime
