#!/bin/bash
# Builds what bench/device/b6.sh carries to the GPU host (issue 26's one device call), from the registry with pip:
#   DEST/whl6/   the 14 wheels pdlb's router and emulated engines and the peers' Python launchers need that the
#                device image lacks (its python3 has aiohttp, numpy, numba, xxhash, msgpack, prometheus-client, pyyaml,
#                jinja2, uvloop, anyio, h11, click, requests, grpcio: see the device notes' package list)
#   DEST/peers6/peers.tar.xz  smg, sglang-router and vllm-router (pinned as bench/router_overhead.py's PEERS): their
#                wheels' files, each Rust extension stripped of debug symbols (strip --strip-unneeded: code and data
#                unchanged), one solid xz archive (~49 MB; unstripped ~60 MB, too much beside the tree for one
#                64 MiB carry)
#   DEST/bin/    b6.sh and the three peers' console-script wrappers (run from the unpacked wheels, no pip there)
# Usage, from the repo root: bash bench/device/prep_issue26.sh [DEST]   (DEST default .dev/device; ~3-6 min on 2 cores)
# Then the device call: command 'bash .dev/device/bin/b6.sh', carry [".dev/device/bin", ".dev/device/whl6",
# ".dev/device/peers6"]. Needs python3 with pip, strip (binutils) and xz here.
set -euo pipefail
DEST=${1:-.dev/device}
HERE=$(cd "$(dirname "$0")" && pwd)
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
#: the peers, as bench/router_overhead.py pins them (tests/bench/test_bench_issue26_table.py checks they agree)
PEER_PINS="smg==1.13.0 sglang-router==0.3.2 vllm-router==0.1.17"
#: what the device image lacks (fastapi needs opentelemetry-api; the peers import fastapi, uvicorn, orjson and
#: setproctitle at start; pdlb needs pydantic, httptools and simpy)
WHEEL_PINS="annotated-types==0.8.0 fastapi==0.165.0 httptools==0.9.0 opentelemetry-api==1.45.3 orjson==3.13.0
pydantic==2.14.4 pydantic-core==2.50.5 setproctitle==1.3.8 simpy==4.1.2 sniffio==1.3.1 starlette==1.10.0
typing-extensions==4.16.0 typing-inspection==0.4.5 uvicorn==0.55.0"
PLAT=""
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux_2_5_x86_64 manylinux1_x86_64; do PLAT="$PLAT --platform $p"; done
DL="python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLAT"
mkdir -p "$DEST/whl6" "$DEST/peers6" "$DEST/bin"
rm -f "$DEST"/whl6/*.whl
$DL -d "$DEST/whl6" $WHEEL_PINS
$DL -d "$TMP/whl" $PEER_PINS
for w in "$TMP"/whl/*.whl; do
  name=$(basename "$w" | cut -d- -f1)  # smg, sglang_router, vllm_router: the folder the wrappers read
  python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" "$w" "$TMP/peers/$name"
done
find "$TMP/peers" -name '*.abi3.so' -print0 | xargs -0 -n1 strip --strip-unneeded
(cd "$TMP/peers" && tar -cf - smg sglang_router vllm_router) | xz -9e --lzma2=preset=9e,dict=256MiB -T1 \
  > "$DEST/peers6/peers.tar.xz"
install -m 755 "$HERE/b6.sh" "$DEST/bin/b6.sh"
wrapper() {  # NAME PACKAGE-FOLDER MODULE:FUNCTION
  cat > "$DEST/bin/$1" <<WRAP
#!/bin/sh
# $1's console script (${3}) from its unpacked wheel in \$PEERS_DIR/$2 (device runs: no pip install)
D=\${PEERS_DIR:-/tmp/peers}
PYTHONPATH=\$D/$2\${PEER_DEPS:+:\$PEER_DEPS} exec \${PEER_PYTHON:-python3} -c 'import sys; sys.argv[0] = "$1"; from ${3%%:*} import ${3##*:}; sys.exit(${3##*:}())' "\$@"
WRAP
  chmod 755 "$DEST/bin/$1"
}
wrapper smg smg smg.cli:main
wrapper sglang-router sglang_router sglang_router.cli:main
wrapper vllm-router vllm_router vllm_router.launch_router:main
du -sb "$DEST/whl6" "$DEST/peers6" "$DEST/bin"
