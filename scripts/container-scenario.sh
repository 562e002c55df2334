#!/usr/bin/env bash
# The whole container scenario on a real Docker engine (docs/deploy.md "Built and run for real"):
# what the test command runs (images built, the compose stack trains to the end, health checks
# healthy, Prometheus's targets up and its query of the trainers' steps answered, the unprivileged
# user, a sidecar killed by its host pid while its trainer trains and brought back by the restart
# policy, `docker stop` / `docker start` through the SIGTERM checkpoint), with the sidecar image
# compiled inside the engine (LW_BINARY=build-cpu) instead of taking this tree's release binary,
# and longer training. 14 minutes with the base image cached (build-image-cache/docker) on 2 busy
# cores, the in-engine compile most of it. As root:
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
