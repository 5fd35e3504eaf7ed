#!/usr/bin/env bash
# Builds what scripts/device_run.sh needs and packs it into .bin/ (gzipped,
# to stay under the 64 MiB a device call may carry), with Fashion-MNIST.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
mkdir -p .bin/data
cargo build --release -p voltaic-cli
strip -o .bin/voltaic target/release/voltaic
cargo test --release --no-run -p voltaic --lib --test gpu --test gpu_runtime --test grad --test train --test bert --test opinfo --test api --test plan_cache --test autotune 2>&1 \
  | grep Executable | sed 's/.*(\(.*\))/\1/' | while read -r f; do
    name=$(basename "$f" | sed 's/-[0-9a-f]*$//'); [ "$name" = voltaic ] && name=lib
    strip -o ".bin/$name" "$f"
done
gzip -f -9 .bin/voltaic .bin/lib .bin/gpu .bin/gpu_runtime .bin/grad .bin/train .bin/bert .bin/opinfo .bin/api .bin/plan_cache .bin/autotune
cp /usr/share/datasets/fashion-mnist/*.gz .bin/data/
du -sh .bin
