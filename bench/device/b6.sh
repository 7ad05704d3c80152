#!/bin/bash
# device call B6 (issue 26, ONE call, <= 560 s of a 600 s limit): the issue's whole table -- regular (smg, sglang-router,
# vllm-router), SGLang PD (smg, sglang-router), vLLM PD (vllm-router); pdlb 1 and 8 processes; req/s, CPU per request,
# added p99; 3 interleaved repeats or as many as fit -- then the route-decision table (every policy, 64/512 ranks,
# 32k-token prompts, KV events at 2,000/s), by bench/issue26_table.py (its doc says what it does).
# Committed as bench/device/b6.sh; bench/device/prep_issue26.sh builds .dev/device/{bin,whl6,peers6} (this script, the
# wheels, the stripped peers) from the registry. Run from the repo root with
# carry [".dev/device/bin", ".dev/device/whl6", ".dev/device/peers6"] (about 53 MB; the tree ~7 MB more):
#   whl6/   the 14 wheels pdlb and the peers need that the device image lacks (fastapi, uvicorn, pydantic, orjson, ...)
#   peers6/ smg 1.13.0, sglang-router 0.3.2 and vllm-router 0.1.17: their PyPI wheels' files, the Rust extension
#           stripped of debug symbols (strip --strip-unneeded; code and data unchanged), as one xz tarball
# Writes under $OUT: b6.log (everything printed), overhead.json (raw per repeat), route.txt, env.txt, peer_logs.txt.
# Knobs (env): LIMIT (s, default 560), DUR (s per run, 2.5), REP (3), RCPUS (router CPUs, 0-7; empty: no pinning),
#   PROCS (1,8), ROUTE_S (s kept for the route table, 130), ROUTE_ARGS (route_latency.py's arguments, default
#   issue26_table.py's), MODES (regular,pd,vllm-pd), EXTRA (more issue26_table.py arguments), VARIANT (one
#   extra pdlb row, NAME=ARGS, issue26_table.py --variant), PY (python3),
#   DEV (.dev/device), SITE (where the wheels go, /tmp/site), PEERS_DIR (/tmp/peers).
set -u -o pipefail
T0=$SECONDS
LIMIT=${LIMIT:-560}; SITE=${SITE:-/tmp/site}; DEV=${DEV:-.dev/device}; PY=${PY:-python3}; OUT=${OUT:-/tmp/b6out}
mkdir -p "$OUT"
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SITE $DEV/whl6/*.whl || exit 1
export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1 PEERS_DIR=${PEERS_DIR:-/tmp/peers} PEER_DEPS=$SITE PEER_PYTHON=$PY
B=$(cd $DEV/bin && pwd)
mkdir -p $PEERS_DIR
for f in $DEV/peers6/*.tar.xz; do
  $PY -c "import sys, tarfile; t = tarfile.open(sys.argv[1]); t.extractall(sys.argv[2], **({'filter': 'data'} if hasattr(tarfile, 'data_filter') else {}))" "$f" $PEERS_DIR &
done
wait
{ date -u; echo "tree: $(git rev-parse --short HEAD 2>/dev/null || echo 'no git here')"; echo "nproc $(nproc)"; lscpu | grep -E "Model name|^CPU\(s\)|Thread|MHz|NUMA node0"; uptime; $PY -VV
  $PY -m pip list 2>/dev/null | grep -iE "^(aiohttp|numpy|numba|uvloop|xxhash|msgpack|prometheus|pydantic|fastapi|uvicorn|orjson|httptools) "
  $PY -c "from balancer import kernels; print('compiled kernels:', kernels.compiled() is not None)"
  ls $PEERS_DIR; ls -la $PEERS_DIR/*/*.so $PEERS_DIR/*/*/*.so 2>/dev/null
  cat $DEV/peers6/README 2>/dev/null | head -20
  echo "setup took $((SECONDS - T0)) s"; } > $OUT/env.txt 2>&1
cat $OUT/env.txt
RC=${RCPUS-0-7}  # unset: 0-7; empty: no pinning
BUDGET=$((LIMIT - (SECONDS - T0) - 15))
timeout $((BUDGET + 10)) $PY bench/issue26_table.py --out $OUT --budget-s $BUDGET --route-s ${ROUTE_S:-130} \
  --duration-s ${DUR:-2.5} --repeat ${REP:-3} --pdlb-processes ${PROCS:-1,8} --modes ${MODES:-regular,pd,vllm-pd} \
  ${RC:+--router-cpus $RC} \
  --engines 4 --pd-engines 2 --load-processes 4 --max-concurrency 256 \
  --smg "$B/smg launch" --sglang-router "$B/sglang-router launch" --vllm-router "$B/vllm-router" \
  ${ROUTE_ARGS:+--route-args "$ROUTE_ARGS"} ${VARIANT:+--variant "$VARIANT"} ${EXTRA:-} 2>&1 | tee $OUT/b6.log
rc=$?
for f in /tmp/pdlb-bench-*.log; do [ -e "$f" ] && { echo "== $f"; tail -n 20 "$f"; }; done > $OUT/peer_logs.txt 2>&1
echo "b6.sh: rc $rc, $((SECONDS - T0)) s"; uptime
