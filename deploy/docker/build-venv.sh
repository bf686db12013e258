#!/bin/sh
# Build the FairFL virtualenv in a builder stage: usage build-venv.sh VENV TORCH_INDEX_URL (run from the source root).
# requirements.txt is used as a constraints file, so every runtime dependency gets its pinned version while the test
# and lint tools it also lists (pytest, ruff, ...) stay out of the image. pip itself is removed at the end: the
# runtime stages copy the finished virtualenv and install nothing.
set -eu
venv=$1
torch_index=$2
torch_version=$(sed -n 's/^torch==//p' requirements.txt)

python3 -m venv "$venv"
"$venv/bin/python" -m pip install --no-cache-dir --upgrade pip
"$venv/bin/python" -m pip install --no-cache-dir --index-url "$torch_index" "torch==$torch_version"
"$venv/bin/python" -m pip install --no-cache-dir --constraint requirements.txt .
"$venv/bin/fairfl" --help >/dev/null
"$venv/bin/python" -m pip uninstall --yes pip
