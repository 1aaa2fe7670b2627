#!/usr/bin/env bash
# Fetch the wheels bench/gpu_wheels.txt lists into DIR (for a GPU box with no package
# index: CPython 3.12, manylinux x86_64), build the three that PyPI has as sources only, and
# print each with its size and the total.
#
#   bench/gpu_wheels.sh DIR [PYTHON]
set -euo pipefail
DIR="${1:?the directory to fill}"
PY="${2:-python3}"
LIST="$(dirname "${BASH_SOURCE[0]}")/gpu_wheels.txt"
mkdir -p "$DIR"
mapfile -t BINARY < <(grep -v '^#' "$LIST" | grep -v 'sdist' | sed 's/#.*//; s/ //g' | grep .)
mapfile -t SOURCE < <(grep -v '^#' "$LIST" | grep 'sdist' | sed 's/#.*//; s/ //g' | grep .)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_31_x86_64 \
    -d "$DIR" "${BINARY[@]}"
"$PY" -m pip wheel -q --no-deps -w "$DIR" "${SOURCE[@]}"
expected=$(( ${#BINARY[@]} + ${#SOURCE[@]} ))
found=$(find "$DIR" -maxdepth 1 -name '*.whl' | wc -l)
[ "$found" -eq "$expected" ] || { echo "expected $expected wheels in $DIR, found $found" >&2; exit 1; }
find "$DIR" -maxdepth 1 -name '*.whl' -printf '%s %f\n' | sort -k2 | awk '{printf "%9.2f MiB  %s\n", $1/1048576, $2; t+=$1} END {printf "%9.2f MiB  in all (%d wheels)\n", t/1048576, NR}'
