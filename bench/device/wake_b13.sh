#!/bin/bash
# device call (session 17, `wake`, issue 26): the CPU per request of a partly idle pdlb process on the 16-core host, in
# ONE call (<= 200 s):
#   (1) equal load: `pdlb serve --processes 1` and `--processes 8` (routers on CPUs 0-7, engines + 4 client processes on
#       8-15) each driven in turn at the same fixed 1,500 req/s, 2 interleaved rounds, regular (EQ_MODES=regular,pd: both)
#       (bench/router_processes_rate.py: CPU per request from /proc, wake-ups = voluntary context switches, x8 / x1 per
#       round; session 16's call 2 read x8 / x1 1.42x in regular, wake-ups 1.29 vs 0.67 per request);
#   (2) where one process's CPU goes as its load falls (bench/partial_load_cpu.py): one process on CPU 0 at 300, 1,500
#       and 9,000 req/s (the last above what it serves: its saturated figure), 2 rounds: user / system split, wake-ups
#       per request and the least-squares cost of one wake-up; the host's price of a wake-up for a bare Python process
#       (--calibrate); the experiment of routers whose loop polls 50 / 150 us after bytes arrive before it blocks
#       (--spin-us, not in pdlb), driven in the same rounds; with TOOLS=1, strace / perf splits when those tools are on
#       the host.
# Run from the repo root with carry [".dev/device/whl6"] (as cores_b11.sh; no peers).
# Writes $OUT/b13.log (everything), $OUT/eq.log + eq.json, $OUT/parts.log + parts.json, $OUT/env.txt.
# Knobs (env): LIM (s in all, 195), EQ_S (s for part 1, 95), RATE (part 1's req/s, 1500), EQ_MODES (regular),
#   RATES (part 2, 300,1500,9000), SPIN (part 2's polling windows in us, 50,150; none: no such rows), ROUNDS (2), DUR (2.5),
#   PY (python3), SKIP_PIP (1: PY's own packages, for a dry run elsewhere), RCPUS (part 1's router CPUs, 0-7),
#   OCPUS (engines and clients, 8-15), PCPU (part 2's router CPU, 0), ENG (4), PDENG (2), LOADP (4), CONNS (64).
#   TOOLS (1: also --strace / --perf where on PATH; ~10 s per rate each).
# Dry run on the 2-core host: SKIP_PIP=1 PY=.venv/bin/python RCPUS=0 OCPUS=1 ENG=1 PDENG=1 LOADP=1 CONNS=32 RATE=300
#   RATES=300,1500 DUR=1.5 LIM=195 bash bench/device/wake_b13.sh
set -u -o pipefail
T0=$SECONDS; OUT=${OUT:-/tmp/wake_b13}; mkdir -p $OUT; PY=${PY:-python3}; LIM=${LIM:-195}
exec > >(tee $OUT/b13.log) 2>&1
if [ -z "${SKIP_PIP:-}" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .dev/device/whl6/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OCPUS=${OCPUS:-8-15}; PCPU=${PCPU:-0}
{ date -u; echo "tree: $(git rev-parse --short HEAD 2>/dev/null || echo 'no git here')"; echo "nproc $(nproc)"
  lscpu | grep -E "Model name|^CPU\(s\)|L2|L3"; uptime; $PY -VV
  echo "strace: $(command -v strace || echo none); perf: $(command -v perf || echo none)"
  cat /sys/devices/system/cpu/cpuidle/current_driver 2>/dev/null; echo "setup took $((SECONDS - T0)) s"; } > $OUT/env.txt 2>&1
cat $OUT/env.txt
left() { echo $((LIM - (SECONDS - T0))); }

echo "== (1) equal load: x1 and x8 at ${RATE:-1500} req/s =="
timeout $(( $(left) < ${EQ_S:-95} ? $(left) : ${EQ_S:-95} )) $PY bench/router_processes_rate.py --modes ${EQ_MODES:-regular} \
  --processes 1,8 --rate ${RATE:-1500} --rounds ${ROUNDS:-2} --duration-s ${DUR:-2.5} --idle-s 2 --router-cpus ${RCPUS:-0-7} \
  --load-processes ${LOADP:-4} --connections ${CONNS:-64} --engines ${ENG:-4} --pd-engines ${PDENG:-2} --out $OUT/eq.json \
  2>&1 | tee $OUT/eq.log
echo "part 1: rc $?, $((SECONDS - T0)) s"

EXTRA=()
[ -n "${TOOLS:-}" ] && command -v strace >/dev/null && EXTRA+=(--strace)
[ -n "${TOOLS:-}" ] && command -v perf >/dev/null && EXTRA+=(--perf)
[ "${SPIN:-50,150}" != none ] && EXTRA+=(--spin-us "${SPIN:-50,150}")
if [ $(left) -gt 30 ]; then
  echo "== (2) one process on CPU $PCPU: where its CPU goes at ${RATES:-300,1500,9000} req/s =="
  # the bench's CPU set {router, others}: the engines and clients go to the others only
  timeout $(( $(left) - 3 )) taskset -c $PCPU,$OCPUS $PY bench/partial_load_cpu.py --modes regular --rates ${RATES:-300,1500,9000} \
    --rounds ${ROUNDS:-2} --duration-s ${DUR:-2.5} --router-cpus $PCPU --load-processes ${LOADP:-4} --connections ${CONNS:-64} \
    --engines ${ENG:-4} --calibrate "${EXTRA[@]}" --out $OUT/parts.json 2>&1 | tee $OUT/parts.log
  echo "part 2: rc $?, $((SECONDS - T0)) s"
else
  echo "part 2 skipped: $(left) s left"
fi
echo "wake_b13.sh: $((SECONDS - T0)) s"; uptime
