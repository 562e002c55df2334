#!/usr/bin/env bash
# Regenerates the committed seed corpora (tests/fuzz/corpus/<target>/) and the generated
# dictionary (tests/fuzz/config_yaml.dict) from a build with -Dfuzz=true (tests/fuzz/README.md).
#
#   tests/fuzz/make_corpus.sh [BUILD_DIR (build-asan)]
#
# The seeds are deterministic: regenerating them changes nothing unless a format, an encoder or a
# documented example changed. Then replays every seed through its target.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
dir=${1:-${LW_BUILD_PREFIX:-build}-asan}
tool=$dir/tests/fuzz/fuzz_corpus
if [[ -f "$dir/build.ninja" ]]; then
  ninja -C "$dir" -j"${LW_JOBS:-2}" tests/fuzz/fuzz_corpus
else
  bash scripts/build.sh asan "$dir"
fi
"$tool" make tests/fuzz/corpus
"$tool" dict tests/fuzz
"$tool" replay tests/fuzz/corpus
du -sh tests/fuzz/corpus
