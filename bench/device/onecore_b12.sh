#!/bin/bash
# device call (session 16, issue 26, onecore): ONE router process's CPU per request on the 16-core host, every mode:
# (1) this tree's one process against the session start's (77eec5c, a git archive carried as a tarball), paired
#     (bench/router_overhead.py --paired-rounds: both driven at once, CPU clocks from /proc, per-round ratios);
# (2) where one process spends it: bench/one_process_profile.py (py-spy by code area and by function, the router on
#     CPU 0, engines + clients + py-spy on the other CPUs), at a rate above one process's capacity (saturated, as
#     b6's x1 rows) in every mode. Python 3.12 there (3.11 on the development host: the asyncio costs differ).
# Run from the repo root with carry [".dev/device/whl6", ".dev/device/pyspy", ".dev/device/base_77eec5c.tgz"]; make
# the tarball with
#   git archive 77eec5c balancer pdlb_cli sim pyproject.toml | gzip > .dev/device/base_77eec5c.tgz   # ~1.5 MB
# Writes $OUT/b12.log (everything), $OUT/paired.log, $OUT/profile.log, $OUT/profile.json, env.txt.
# Knobs (env): LIM (s, 170 in all), PAIRED (rounds, 6), PROF_RATE (req/s offered, 9000), PROF_S (s, 4),
#   MODES (regular,pd,vllm-pd), PY (python3), SKIP_PIP (1: use PY's own packages, for a dry run elsewhere),
#   RCPUS (0-7: the paired routers' CPUs), PAIRED_S (s for the paired part; default LIM - 55).
# Call 2 (16:41, main with e7eca01 + this script's first version): the paired part measured regular only before its
# 90 s (a cold machine: ~80 s for the first mode, kernels compiled for both trees): 0.92x (rounds 0.82-0.98); the profile
# part printed regular only. For a <= 120 s call: MODES=pd LIM=118 PAIRED_S=85 (SGLang PD paired + its profile).
# Expected on the 16-core host: ~105 s paired (3 modes x (start + one repeat ~20 s, 6 rounds x 2.5 s)), ~45 s profiles
# (3 x (start ~5 s, 1 s warm-up, 4 s sampled)); the profiles get what is left of LIM. Dry run on the 2-core host
# (SKIP_PIP=1 PY=.venv/bin/python RCPUS=0 MODES=pd PAIRED=2 PROF_RATE=1500 PROF_S=2): rc 0, 59 s.
set -u -o pipefail
T0=$SECONDS; OUT=${OUT:-/tmp/onecore_b12}; mkdir -p $OUT; PY=${PY:-python3}; LIM=${LIM:-170}
exec > >(tee $OUT/b12.log) 2>&1
if [ -z "${SKIP_PIP:-}" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .dev/device/whl6/*.whl .dev/device/pyspy/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH
SPY=$(command -v py-spy || true)
{ date; nproc; uptime; $PY -VV; git log -1 --format=%H 2>/dev/null; echo "py-spy: ${SPY:-none}"; } > $OUT/env.txt
cat $OUT/env.txt
BASE=()
if [ -f .dev/device/base_77eec5c.tgz ]; then
  mkdir -p /tmp/base77 && tar -xzf .dev/device/base_77eec5c.tgz -C /tmp/base77 && BASE=(--baseline /tmp/base77)
fi
left() { echo $((LIM - (SECONDS - T0))); }
if [ ${#BASE[@]} -gt 0 ]; then
  echo "== (1) one process, this tree vs 77eec5c, paired =="
  timeout ${PAIRED_S:-$(( $(left) - 55 ))} $PY bench/router_overhead.py --peers none --modes ${MODES:-regular,pd,vllm-pd} \
    --pdlb-processes 1 "${BASE[@]}" --paired-rounds ${PAIRED:-6} --repeat 1 --duration-s 2 --router-cpus ${RCPUS:-0-7} \
    --engines 4 --pd-engines 2 --load-processes 4 2>&1 | tee $OUT/paired.log
  echo "paired: rc $?, $((SECONDS - T0)) s"
else
  echo "no .dev/device/base_77eec5c.tgz: paired part skipped"
fi
if [ -n "$SPY" ] && [ $(left) -gt 20 ]; then
  echo "== (2) one process's profile by code area, saturated =="
  timeout $(( $(left) - 3 )) $PY bench/one_process_profile.py --modes ${MODES:-regular,pd,vllm-pd} --rate ${PROF_RATE:-9000} \
    --connections 256 --load-processes 4 --engines 4 --pd-engines 2 --duration-s ${PROF_S:-4} --router-cpus 0 \
    --py-spy "$SPY" --top 40 --json $OUT/profile.json 2>&1 | tee $OUT/profile.log
  echo "profile: rc $?, $((SECONDS - T0)) s"
fi
echo "onecore_b12.sh: $((SECONDS - T0)) s"; uptime
