#!/usr/bin/env bash
# On the GPU machine: reassemble the bundle parts (bench/vllm_gpu/bundle.sh) kept in PARTS_DIR, unpack them
# into SITE_DIR and declare mok's vLLM plugin entry point there (the repository is not pip-installed on that
# machine: vLLM finds plugins through installed distributions' entry points). Then:
#     export PYTHONPATH=SITE_DIR:. VLLM_USE_FLASHINFER_SAMPLER=0
#     usage: bench/vllm_gpu/unpack.sh [PARTS_DIR=/tmp/vllm-parts] [SITE_DIR=/tmp/site]
set -euo pipefail
PARTS=${1:-/tmp/vllm-parts}
SITE=${2:-/tmp/site}
mkdir -p "$SITE"
cat "$PARTS"/part.* | xz -dc -T0 | tar -xf - -C "$SITE"
dist="$SITE/mok_vllm_plugin-0.0.dist-info"
mkdir -p "$dist"
printf 'Metadata-Version: 2.1\nName: mok-vllm-plugin\nVersion: 0.0\n' > "$dist/METADATA"
printf '[vllm.general_plugins]\nmok = rl.vllm.plugin:register\n' > "$dist/entry_points.txt"
echo "vLLM bundle unpacked into $SITE ($(du -sh "$SITE" | cut -f1))"
