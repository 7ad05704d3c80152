#!/bin/bash
# device call (session 16, `cores`, issue 26): why 8 router processes cost 1.5-2.1x one process's CPU per request on the
# 16-core host, in ONE call (bench/router_cores.py; its docstring says what each phase measures):
#   1. host or pdlb: one pdlb process (and vllm-router) pinned to CPU 0, fixed 1,500 req/s and closed loop, with CPUs 1-7
#      idle vs running busy loops; x8 vs x1 at the same offered rate;
#   2. does follow_load settle inside b6's 2.5 s closed-loop runs: each router process's CPU and
#      pdlb_router_processes_active every 0.1 s in every x8 window, and 8 s windows at 256 and 16 clients (SGLang PD);
#   3. per-process pinning (row `x8 pin`: --pin-processes when the tree has it, else the bench pins each process).
# Routers on CPUs 0-7, engines + 4 client processes on 8-15 (as b6). Modes regular, SGLang PD, vLLM PD; 2 interleaved
# repeats; every ratio from windows of the same run.
# Run from the repo root with carry [".dev/device/whl6", ".dev/device/peers6"] (~53 MB; only vllm-router is unpacked).
# Writes $OUT/b11.log (everything printed), $OUT/b11.json (raw: every window, the time lines), $OUT/env.txt.
# Knobs (env): LIM (s for the whole script, 240), DUR (s per window, 2.5), REP (2), RATE (1500), MODES (regular,pd,vllm-pd),
#   HOST_MODES (regular), LONG_MODES (pd), LONG_S (8), BURN (spin), RCPUS (0-7), ENG (4), PDENG (2), LOADP (4),
#   MAXC (256), PROBE (CPUs for the topology probe, e.g. 1-15: x1 on CPU 0 with one busy loop on each in turn; none),
#   ROWS (optional rows: rr,pin,burn; default all), VARIANT (NAME=ARGS: one more x8 row), PY (python3), SKIP_PIP (1: PY's own packages, for a dry run elsewhere), VR (vllm-router's command; none: no vllm-router).
# Dry run on the 2-core host: SKIP_PIP=1 PY=.venv/bin/python RCPUS=0-1 ENG=1 PDENG=1 LOADP=1 MAXC=64 RATE=200 DUR=1 REP=1
#   LONG_S=2 VR=~/.cache/pdlb-peers/vllm-router-0.1.17/bin/vllm-router bash bench/device/cores_b11.sh
set -u -o pipefail
T0=$SECONDS; LIM=${LIM:-240}; OUT=${OUT:-/tmp/b11out}; mkdir -p $OUT; PY=${PY:-python3}; SITE=${SITE:-/tmp/site}
if [ -z "${SKIP_PIP:-}" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SITE .dev/device/whl6/*.whl || exit 1
fi
export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1
if [ "${VR:-}" = none ]; then VR=; elif [ -z "${VR:-}" ] && [ -f .dev/device/peers6/peers.tar.xz ]; then
  export PEERS_DIR=/tmp/peers; mkdir -p $PEERS_DIR
  $PY -c "import sys, tarfile; t = tarfile.open(sys.argv[1]); t.extractall(sys.argv[2], members=[m for m in t if m.name.startswith('vllm_router')], **({'filter': 'data'} if hasattr(tarfile, 'data_filter') else {}))" .dev/device/peers6/peers.tar.xz $PEERS_DIR
  printf '#!/bin/sh\nPYTHONPATH=%s exec %s -c "import sys; sys.argv[0] = \\"vllm-router\\"; from vllm_router.launch_router import main; sys.exit(main())" "$@"\n' "$PEERS_DIR/vllm_router:$SITE" "$PY" > /tmp/vllm-router; chmod +x /tmp/vllm-router
  VR=/tmp/vllm-router
fi
{ date -u; echo "tree: $(git rev-parse --short HEAD 2>/dev/null || echo 'no git here')"; echo "nproc $(nproc)"
  lscpu | grep -E "Model name|^CPU\(s\)|Thread|MHz|NUMA node0|L3"; uptime; $PY -VV; echo "vllm-router: ${VR:-none}"
  cat /sys/devices/system/cpu/cpu0/cpufreq/scaling_governor 2>/dev/null; echo "setup took $((SECONDS - T0)) s"; } > $OUT/env.txt 2>&1
cat $OUT/env.txt
BUDGET=$((LIM - (SECONDS - T0) - 12))
timeout $((BUDGET + 10)) $PY bench/router_cores.py --budget-s $BUDGET --modes ${MODES:-regular,pd,vllm-pd} \
  --host-modes ${HOST_MODES:-regular} --long-modes ${LONG_MODES:-pd} --long-s ${LONG_S:-8} --burner ${BURN:-spin} ${PROBE:+--probe-cpus $PROBE} ${ROWS+--rows "$ROWS"} \
  ${VARIANT:+--variant "$VARIANT"} \
  --rate ${RATE:-1500} --duration-s ${DUR:-2.5} --repeat ${REP:-2} --router-cpus ${RCPUS:-0-7} --engines ${ENG:-4} \
  --pd-engines ${PDENG:-2} --load-processes ${LOADP:-4} --max-concurrency ${MAXC:-256} ${VR:+--vllm-router "$VR"} \
  --out $OUT/b11.json 2>&1 | tee $OUT/b11.log
rc=$?
for f in /tmp/pdlb-bench-vllm-router-*.log; do [ -e "$f" ] && { echo "== $f"; tail -n 20 "$f"; }; done >> $OUT/b11.log 2>&1
echo "cores_b11.sh: rc $rc, $((SECONDS - T0)) s"; uptime
