#!/bin/bash
# device call B8 (session 14, issue 26 diagnosis): pdlb's CPU per request against its process count (1, 2, 4, 8) in
# every mode, and 8 processes on uvloop, routers on CPUs 0-7, engines + clients on 8-15; no peers (b6 has them).
# Question: is 8 processes' 2.00x (SGLang PD) a per-request cost of sharing, or a half-idle loop's cost (not saturated)?
set -u -o pipefail
T0=$SECONDS; OUT=${OUT:-/tmp/b8out}; mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .dev/device/whl6/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -c "import uvloop; print('uvloop', uvloop.__version__)"; nproc; uptime
timeout ${LIM:-300} python3 bench/router_overhead.py --peers none --modes pd,vllm-pd,regular --pdlb-processes 1,2,4,8 \
  --variant 'uvloop x8=--event-loop uvloop --processes 8' --repeat ${REP:-2} --duration-s ${DUR:-2.5} --router-cpus ${RCPUS:-0-7} \
  --engines 4 --pd-engines 2 --load-processes 4 --max-concurrency 256 2>&1 | tee $OUT/b8.log
echo "b8.sh: rc $?, $((SECONDS - T0)) s"; uptime
