#!/bin/bash
# The GPU checks of issue 18, in one go, for a session lent an NVIDIA machine (none of this runs in CI).
#
# Here, first (binaries are built on this machine and carried; the GPU machine has no Rust toolchain):
#   EXTRA_FEATURES=cupti tools/device_build.sh            # -> .dev/bin, stripped
#   and the NVIDIA ICD's libraries for Vulkan, as the device README says:
#   echo /.gl/ >>.git/info/exclude; mkdir -p .gl /tmp/amd64/partial; o='-oAPT::Architecture=amd64
#   -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/amd64'; apt-get $o update; (cd .gl && apt-get $o download
#   libvulkan1 libegl1 libglvnd0 libopengl0 libgl1 libglx0 libgles2)
# Then one device call: command `bash tools/device_check.sh`, carry [".dev", ".gl"]. Everything logs to
# $OUT/log; traces land in $OUT (check them here with .ci/check_perfetto.py and `tickline stats`).
exec > >(tee -a "$OUT/log") 2>&1
B=.dev/bin
T() { echo; echo "=== $* ($(date +%T))"; }
T machine; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; nproc
CUPTI_LIB=$(find /usr/local/cuda*/ -name 'libcupti.so' 2>/dev/null | head -1); echo "libcupti: $CUPTI_LIB"
CL=$(dirname "$CUPTI_LIB"); CI=$(find /usr/local/cuda*/ -name cupti.h 2>/dev/null | head -1)
[ -n "$CI" ] || CI=$PWD/.dev/cupti/include/cupti.h  # tools/device_build.sh fetched them
T cupti probe
timeout 120 nvcc -O2 -arch=sm_90 -I "$(dirname "$CI")" -o /tmp/probe tools/cupti_probe.cu -L"$CL" -lcupti -lcuda \
    -Xlinker -rpath -Xlinker "$CL" && { timeout 60 /tmp/probe mono; echo "--- default clock"; timeout 60 /tmp/probe | head -40; }
export TICKLINE_CUPTI_LIBRARY=$CUPTI_LIB
T cuda and cupti tests; timeout 150 $B/it cuda --nocapture --test-threads=1; timeout 150 $B/it cupti --nocapture --test-threads=1
T cuda_kernels; timeout 60 $B/cuda_kernels $OUT/cuda_kernels.pftrace
T cuda_kernels with CUPTI; timeout 60 $B/cuda_kernels --cupti $OUT/cupti_kernels.pftrace
T cuda_scope bench; timeout 90 $B/cuda_scope --bench --warm-up-time 1 --measurement-time 4 --noplot
T cuda_accuracy; timeout 100 $B/cuda_accuracy "${ACC_SECONDS:-60}" $OUT/cuda_accuracy.pftrace
T vulkan; for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
export __EGL_VENDOR_LIBRARY_FILENAMES=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json
timeout 120 $B/it vulkan --nocapture --test-threads=1
timeout 60 $B/vulkan_compute $OUT/vulkan_compute.pftrace
T gpu_scope bench, Vulkan; timeout 60 $B/gpu_scope --bench --warm-up-time 1 --measurement-time 3 --noplot
T done
