#!/usr/bin/env bash
# Runs on the GPU device machine, from the repository root: unpacks .device/hypic-device.tar.xz
# (scripts/pack-device.sh), makes the paths compiled into the binaries valid there, and runs the
# given command with the packed binaries first on PATH and their libraries on LD_LIBRARY_PATH.
# Usage (device): bash scripts/device-run.sh <command...>
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dest=/tmp/hypic-device
mkdir -p "$dest"
tar -C "$dest" -xJf "$root/.device/hypic-device.tar.xz"
# Binaries built here name their source folder (test data, the default model) by absolute path.
src="$(cat "$dest/srcdir")"
if [ "$src" != "$root" ] && [ ! -e "$src" ]; then mkdir -p "$(dirname "$src")" && ln -s "$root" "$src"; fi
export PATH="$dest/bin:$PATH" LD_LIBRARY_PATH="$dest/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
exec "$@"
