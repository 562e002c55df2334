#!/usr/bin/env bash
# The whole container scenario on a real Docker engine (docs/deploy.md "Built and run for real"):
# what the test command runs (images built, the compose stack trains to the end, health checks
# healthy, Prometheus's targets up and its query of the trainers' steps answered, the unprivileged
# user) plus the failures — a sidecar killed by its host pid while its trainer trains (the trainer
# falls back, the restart policy brings the sidecar back, compressed steps resume) and `docker
# stop` / `docker start` of a sidecar (its SIGTERM checkpoint on the volume, restored from it).
# About 2 minutes with the images cached (build-image-cache/docker), 4 without. As root:
#
#   bash scripts/container-scenario.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python=${PYTHON:-/usr/bin/python3}
dir=${LW_BUILD_PREFIX:-build}-release
[[ -x "$dir/proxy/lightwire" ]] || bash scripts/build.sh release "$dir"
LW_CONTAINER_SCENARIO=full LIGHTWIRE_BIN=$PWD/$dir/proxy/lightwire \
  PYTHONPATH=clients/python${PYTHONPATH:+:$PYTHONPATH} \
  "$python" -m pytest -v -p no:cacheprovider tests/python/test_containers.py
