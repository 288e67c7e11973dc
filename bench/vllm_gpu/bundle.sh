#!/usr/bin/env bash
# Assemble vLLM 0.26.0 for the H200 machine, which has torch 2.11.0+cu130 and triton 3.6.0 but no package
# index and accepts at most 64 MiB of files per command: download the wheels of vLLM 0.26.0 (the newest
# release pinning torch 2.11) and of the packages it needs that the H200 image lacks (packages-0.26.0.txt),
# unpack them into one site folder, drop what mok's backends never load, pack as tar.xz and split it into
# parts of 60 MiB. Run here (a machine with the package index):
#     bench/vllm_gpu/bundle.sh [OUT_DIR]      # default build/vllm-gpu; prints the parts
#     PACKAGES=bench/vllm_gpu/packages-verl-0.9.1.txt bench/vllm_gpu/bundle.sh build/verl-gpu   # verl's, beside it
# A line of the packages file ending in "# sdist" names a pure-Python package published without a wheel: it is
# built into one here.
# There, sending the parts in back-to-back commands (files outside the repository stay while the machine
# stays up): docs/development.md, "The H200 vLLM bundle", gives the commands.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${1:-build/vllm-gpu}
PACKAGES=${PACKAGES:-$HERE/packages-0.26.0.txt}
PIP=${PIP:-python3 -m pip}
mkdir -p "$OUT/wheels"
rm -rf "$OUT/site" "$OUT/parts" && mkdir -p "$OUT/site" "$OUT/parts"
platforms=()
for tag in manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_24_x86_64 \
           manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64 linux_x86_64; do
    platforms+=(--platform "$tag")
done
# the H200 machine: CPython 3.12 on x86-64 Linux (glibc 2.35)
grep -v "# sdist" "$PACKAGES" > "$OUT/wheels.txt" || true
grep "# sdist" "$PACKAGES" | sed 's/#.*//' > "$OUT/sdists.txt" || true
$PIP download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
    -r "$OUT/wheels.txt" -d "$OUT/wheels"
if [ -s "$OUT/sdists.txt" ]; then
    $PIP wheel -q --no-deps -r "$OUT/sdists.txt" -w "$OUT/wheels"
fi
# unpacked keeping the files' executable bits (ray's raylet and gcs_server are programs it starts)
python3 - "$OUT/site" "$OUT"/wheels/*.whl <<'PY'
import os, sys, zipfile
for wheel in sys.argv[2:]:
    with zipfile.ZipFile(wheel) as archive:
        for info in archive.infolist():
            path = archive.extract(info, sys.argv[1])
            if (info.external_attr >> 16) & 0o111:
                os.chmod(path, (info.external_attr >> 16) & 0o777)
PY
# Never loaded with the Triton-based backends mok registers (the FA3 binary stays: qwen3_moe.py imports
# vllm.vllm_flash_attn unguarded, which needs FA2 or FA3; pynvml.py and the two stable-libtorch .so stay).
rm -rf "$OUT/site/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so" "$OUT/site/vllm/third_party/deep_gemm" \
       "$OUT/site/vllm/third_party/fmha_sm100" "$OUT/site/vllm/vllm-rs" "$OUT/site/vllm/_flashmla_C.abi3.so" \
       "$OUT/site/xgrammar/lib/libxgrammar.a"
# verl's wheel ships top-level `tests` and `scripts` packages, which would shadow the repository's own
rm -rf "$OUT/site/tests" "$OUT/site/scripts"
find "$OUT/site" -name "__pycache__" -type d -prune -exec rm -rf {} +
tar -C "$OUT/site" -cf - . | xz -T0 -6 > "$OUT/bundle.tar.xz"
split -b 60M -d "$OUT/bundle.tar.xz" "$OUT/parts/part."
rm -f "$OUT/bundle.tar.xz"
ls -l "$OUT/parts"
