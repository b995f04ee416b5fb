#!/usr/bin/env bash
# The GPU run of the load path, prepared to fit in 5 minutes on a machine with
# an NVIDIA GPU and no package registry (docs/SEMANTICS.md "Loading onto a
# device"; the facts of that machine are in the design notes). Nothing is
# built there: the binaries and wheels come along in gpu-carry/ (made here by
# `scripts/gpu-check.sh --pack`). One run, on one checkpoint of SIZE_GIB
# (default 8) GiB, page cache warm (and cold where caches can be dropped):
# machine facts, torch's pinned and pageable host-to-device copy of 1 GiB (the
# limit), safetensors.torch.load_file, fastsafetensors, instanttensor, stfs
# load_all and the daemon's own time, every tensor compared on the GPU with the
# file, an edited and a new tensor, ENODEV for a device that is not there. It
# writes OUT/gpu-check.json and prints a table of GB/s and ratios to the pinned
# copy. Without /dev/fuse (after trying modprobe and mknod) it runs the engine
# benchmark alone.
#
#   scripts/gpu-check.sh --pack          # here: build, fill gpu-carry/ (stfs, load bench, wheels)
#   scripts/gpu-check.sh [OUT]           # there (or here: the host engine, CUDA answering ENODEV)
set -euo pipefail
cd "$(dirname "$0")/.."
carry=gpu-carry
if [ "${1:-}" = "--pack" ]; then
  cargo build --release --locked
  cargo bench --locked --bench load --no-run 2>&1 | tail -1
  mkdir -p "$carry/wheels"
  cp target/release/stfs "$carry/stfs" && strip "$carry/stfs"
  bench=$(ls -t target/release/deps/load-* | grep -v '\.d$' | head -1)
  cp "$bench" "$carry/load-bench" && strip "$carry/load-bench"
  for w in fastsafetensors==0.5.0 instanttensor==0.2.2; do
    pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d "$carry/wheels" "$w" ||
      echo "gpu-check: no wheel for $w (its row will say so)"
  done
  du -sh "$carry"
  exit 0
fi
out=$(realpath -m "${1:-/tmp/stfs-gpu-check}")
mkdir -p "$out"
work=$(mktemp -d /var/tmp/stfs-gpu-XXXXXX)
stfs=$PWD/$carry/stfs
[ -x "$stfs" ] || stfs=$PWD/target/release/stfs
bench=$PWD/$carry/load-bench
mnt=$work/mnt
mkdir -p "$mnt"
cleanup() {
  if grep -q " $mnt " /proc/self/mountinfo; then "$stfs" umount --discard "$mnt" || umount -l "$mnt"; fi
  rm -rf "$work"
}
trap cleanup EXIT
if [ -d "$carry/wheels" ] && ls "$carry"/wheels/*.whl >/dev/null 2>&1; then
  pip install -q --no-index --no-deps --target "$work/site" "$carry"/wheels/*.whl 2>&1 | tail -2 || true
fi
export PYTHONPATH="$PWD/python:$work/site" STFS="$stfs"
echo "== machine"
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current,memory.total \
  --format=csv 2>&1 | tee "$out/nvidia-smi.txt" || echo "no nvidia-smi"
if [ ! -e /dev/fuse ]; then
  modprobe fuse 2>/dev/null || true
  [ -e /dev/fuse ] || mknod /dev/fuse c 10 229 2>/dev/null || true
fi
echo "== checkpoint: ${SIZE_GIB:-8} GiB"
python3 - "$work/ckpt.safetensors" "${SIZE_GIB:-8}" <<'PY'
import sys, numpy as np
from safetensors.numpy import save_file
path, gib = sys.argv[1], float(sys.argv[2])
n = max(1, int(gib * 4))  # tensors of 256 MiB, F16 and F32 (and odd sizes)
rng = np.random.default_rng(0)
t = {f"layer.{i:03d}.weight": np.frombuffer(rng.bytes(256 << 20), np.float16 if i % 2 else np.float32)
     .reshape(4096, -1) for i in range(n)}
t["odd.bias"] = rng.standard_normal(1234567).astype(np.float32)
t["empty"] = np.zeros((0,), np.float16)
save_file(t, path)
PY
cat "$work/ckpt.safetensors" > /dev/null
mounted=0
if [ -e /dev/fuse ] && "$stfs" mount --log-file "$work/stfs.log" "$work/ckpt.safetensors" "$mnt"; then
  mounted=1
else
  echo "gpu-check: no FUSE mount here: the engine benchmark alone"
fi
status=0
if [ "$mounted" = 1 ]; then
  python3 scripts/gpu_check.py "$work/ckpt.safetensors" "$mnt" "$out/gpu-check.json" || status=$?
  cp "$work/stfs.log" "$out/stfs.log" || true
fi
if [ -x "$bench" ]; then
  echo "== engine benchmark (no FUSE)"
  STFS_BENCH_CUDA=0 "$bench" "$work/ckpt.safetensors" 2>&1 | tee "$out/load-bench.txt" || status=1
fi
exit "$status"
