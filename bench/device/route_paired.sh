#!/bin/bash
# Device call (issue 26, route decisions; <= 200 s): this tree's Router.route paired against a baseline tree in one run
# on the same host -- ep_aware, scored and kv_cost at 64 and 512 DP ranks per pool (32k-token prompts, KV events at
# 2,000/s applied concurrently, 256 in flight, thread CPU clock), interleaved rounds, medians and ratios (this / base),
# then the host calibration line route_latency prints (to scale figures between hosts). Run from the repo root.
# The baseline: a tarball of the base commit's balancer/ and bench/route_latency.py, built here with
#   git archive <base> balancer bench/route_latency.py | gzip > .dev/device/base_<base>.tgz
# Carry: [".dev/device/whl6", ".dev/device/base_<base>.tgz"] (whl6: numba, xxhash, ... that the device image lacks).
# Knobs (env): BASE_TGZ (.dev/device/base_389e2e6.tgz), POLICIES (ep_aware,scored,kv_cost), REPL (64,512), ROUNDS (2),
#   REQUESTS (1000), LIMIT (s, 190), SKIP_PIP (dry runs: use the installed packages), PY (python3), OUT (/tmp/rpout).
set -u -o pipefail
T0=$SECONDS
SITE=${SITE:-/tmp/site}; DEV=${DEV:-.dev/device}; PY=${PY:-python3}; OUT=${OUT:-/tmp/rpout}
BASE_TGZ=${BASE_TGZ:-$DEV/base_389e2e6.tgz}; LIMIT=${LIMIT:-190}
mkdir -p "$OUT" /tmp/rp_base
[ -n "${SKIP_PIP:-}" ] || $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SITE \
  $DEV/whl6/*.whl || exit 1
export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1
tar -xzf "$BASE_TGZ" -C /tmp/rp_base || exit 1
# compile (or load) both trees' kernels once before the timed children (numba caches them beside the sources)
$PY -c "from balancer import kernels; print('compiled kernels (this tree):', kernels.compiled() is not None)"
(cd /tmp/rp_base && $PY -c "from balancer import kernels; print('compiled kernels (base):', kernels.compiled() is not None)")
timeout $((LIMIT - (SECONDS - T0))) $PY bench/route_latency.py --against /tmp/rp_base \
  --policies ${POLICIES:-ep_aware,scored,kv_cost} --replicas ${REPL:-64,512} --rounds ${ROUNDS:-2} \
  --prompts 32768 --requests ${REQUESTS:-1000} --clock cpu --in-flight 256 --kv-events-per-s 2000 2>&1 | tee $OUT/route_paired.txt
echo "route_paired.sh: $((SECONDS - T0)) s"; uptime
