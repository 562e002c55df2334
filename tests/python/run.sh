#!/bin/sh
# Runs the Python client's tests from the repository root: all of tests/python, or the test files
# given first (paths from the root); pytest options after them.
# PYTHON (default /usr/bin/python3), LIGHTWIRE_BIN (default build-release/proxy/lightwire).
set -e
cd "$(dirname "$0")/../.."
where=tests/python
if [ $# -gt 0 ] && [ -e "${1%%::*}" ]; then
  where=""
fi
PYTHONPATH="clients/python${PYTHONPATH:+:$PYTHONPATH}" exec "${PYTHON:-/usr/bin/python3}" -m pytest -q -p no:cacheprovider $where "$@"
