#!/bin/bash
# device call (session 14, `front`, issue 26): ONE pdlb process's CPU per request, paired against the session
# start (389e2e6), in regular, SGLang PD and vLLM PD modes (bench/front_paired.py: every variant driven at once by the
# same clients, zero-delay emulated engines). Variants: the session start; this tree's defaults (lean HTTP front,
# uvloop); this tree on the standard loop (lean front); this tree with aiohttp's front on the standard loop.
# Carry: .dev/device/whl6 (wheels; the image has uvloop) and .dev/device/base_389e2e6.tgz (or BASE_TGZ's file)
#   (git archive 389e2e6 balancer pdlb_cli sim pyproject.toml | gzip). ~150 s on 16 cores (LIM caps each mode).
set -u -o pipefail
T0=$SECONDS; OUT=${OUT:-/tmp/b9out}; mkdir -p $OUT
PY=${PY:-python3}  # dry run elsewhere: PY=.venv/bin/python SKIP_PIP=1
[ -n "${SKIP_PIP:-}" ] || $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .dev/device/whl6/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
$PY -c "import uvloop, httptools; print('uvloop', uvloop.__version__, 'httptools', httptools.__version__)"; nproc; uptime
BASE_TGZ=${BASE_TGZ:-.dev/device/base_389e2e6.tgz}  # another base: git archive <commit> balancer pdlb_cli sim pyproject.toml | gzip
BASE=/tmp/base_$(basename $BASE_TGZ .tgz); mkdir -p $BASE && tar -xzf $BASE_TGZ -C $BASE || exit 1
for m in ${MODES:-regular pd vllm-pd}; do
  timeout ${LIM:-60} $PY bench/front_paired.py --mode $m --rounds ${ROUNDS:-6} --duration-s ${DUR:-2.5} \
    --concurrency ${CONC:-32} --load-processes ${LOADP:-2} --router-cpus ${RCPUS:-0-3} \
    "$BASE::" ".::" ".::--event-loop asyncio" ".::--http-front aiohttp --event-loop asyncio" 2>&1 | tee -a $OUT/b9.log
done
echo "front_b9.sh: rc $?, $((SECONDS - T0)) s"; uptime
