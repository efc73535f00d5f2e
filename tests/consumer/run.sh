#!/bin/sh
# Runs the built application at 2 ranks under the fsdp-run on PATH (the installed one):
#   run.sh BUILD_DIR
# scripts/release/deb-check.sh calls it after building this project against the .deb.
set -e
rm -rf "$1/ck"
exec fsdp-run --nproc 2 -- "$1/consumer_app" "$1/ck"
