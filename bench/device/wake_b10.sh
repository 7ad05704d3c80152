#!/bin/bash
# device call (session 15, `wake`, issue 26): pdlb's CPU per request at 8 processes with the connection placement
# that follows the load (the default since this session: connections on as few processes as the load needs) against
# the old placement (every process in turn, `--connection-placement round_robin`), and one process, in SGLang PD,
# vLLM PD and regular modes; routers on CPUs 0-7, engines + clients on 8-15 (as b6/b8); no peers (b6 has them).
# Question: does x8 come down from ~2.0x (SGLang PD) / 1.5x (vLLM PD) / 1.37x (regular) one process's CPU per request
# toward <= 1.3x, at the same max req/s and added p99?
# Carry: .dev/device/whl6 (as b6). ~190 s on 16 cores (LIM caps it; modes in priority order).
set -u -o pipefail
T0=$SECONDS; OUT=${OUT:-/tmp/b10out}; mkdir -p $OUT
PY=${PY:-python3}  # dry run elsewhere: PY=.venv/bin/python SKIP_PIP=1 RCPUS=0 ENG=1 LOADP=1 MAXC=64 REP=1 DUR=1
[ -n "${SKIP_PIP:-}" ] || $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .dev/device/whl6/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
$PY -c "import uvloop; print('uvloop', uvloop.__version__)"; nproc; uptime
N=${N:-8}
timeout ${LIM:-190} $PY bench/router_overhead.py --peers none --modes ${MODES:-pd,vllm-pd,regular} --pdlb-processes 1,$N \
  --variant "round robin x$N=--connection-placement round_robin --processes $N" --repeat ${REP:-2} --duration-s ${DUR:-2.5} \
  --router-cpus ${RCPUS:-0-7} --engines ${ENG:-4} --pd-engines ${ENG:-2} --load-processes ${LOADP:-4} \
  --max-concurrency ${MAXC:-256} 2>&1 | tee $OUT/b10.log
echo "wake_b10.sh: rc $?, $((SECONDS - T0)) s"; uptime
