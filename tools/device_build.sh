#!/bin/bash
# Builds the binaries tools/device_check.sh runs on a GPU machine, stripped, into .dev/bin (carried there).
set -e
cd "$(dirname "$0")/.."
rm -rf .dev/bin && mkdir -p .dev/bin
cargo build --release --features cuda,vulkan${EXTRA_FEATURES:+,$EXTRA_FEATURES} --tests --examples 2>&1 | tail -1
for t in $(cargo test --release --features cuda,vulkan${EXTRA_FEATURES:+,$EXTRA_FEATURES} --test it --no-run --message-format=json 2>/dev/null | grep -o '"executable":"[^"]*"' | cut -d'"' -f4); do cp "$t" .dev/bin/it; done
for e in cuda_kernels vulkan_compute cuda_accuracy $EXTRA_EXAMPLES; do [ -f target/release/examples/$e ] && cp target/release/examples/$e .dev/bin/; done
for t in $(cargo bench -p tickline-benches --features cuda,vulkan --no-run --bench cuda_scope --bench gpu_scope --message-format=json 2>/dev/null | grep -o '"executable":"[^"]*"' | cut -d'"' -f4); do cp "$t" .dev/bin/$(basename "$t" | sed 's/-[0-9a-f]*$//'); done
strip .dev/bin/*
# CUPTI's headers, for the probe, in case the GPU machine's toolkit lacks them (NVIDIA's wheel from PyPI).
if [ ! -f .dev/cupti/include/cupti.h ]; then
    mkdir -p .dev/cupti && d=$(mktemp -d)
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
        --platform manylinux_2_25_x86_64 --platform manylinux_2_28_x86_64 -d "$d" "nvidia-cuda-cupti==13.0.85" \
        && python3 -m zipfile -e "$d"/nvidia_cuda_cupti-*.whl "$d/x" && cp -r "$d/x/nvidia/cu13/include" .dev/cupti/ \
        || echo "CUPTI headers not fetched: the probe needs the toolkit's"
    rm -rf "$d"
fi
ls -la .dev/bin
