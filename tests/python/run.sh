#!/bin/sh
# Runs the Python client's tests from the repository root.
# PYTHON (default /usr/bin/python3), LIGHTWIRE_BIN (default build-release/proxy/lightwire).
set -e
cd "$(dirname "$0")/../.."
PYTHONPATH="clients/python${PYTHONPATH:+:$PYTHONPATH}" exec "${PYTHON:-/usr/bin/python3}" -m pytest -q -p no:cacheprovider tests/python "$@"
