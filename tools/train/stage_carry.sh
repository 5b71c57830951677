#!/bin/sh
# Copy what a device call brought back (checkpoint parts, bundle.tar) into the carried folder
# .hypic-train/ (ignored through .git/info/exclude), so that the next call can resume from it.
# usage: tools/train/stage_carry.sh FILES_AT_DIR
set -e
src="$1"
dst="$(dirname "$0")/../../.hypic-train"
mkdir -p "$dst"
rm -f "$dst"/ckpt.*
cp "$src"/ckpt.* "$dst"/
tar -xf "$src"/bundle.tar -C "$dst"
ls -la "$dst"
