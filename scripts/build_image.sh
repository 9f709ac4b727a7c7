#!/usr/bin/env bash
# Build the Docker image for real without a Docker engine (buildah, as root), run the demo inside it,
# check the installed versions against the lock file, then build again from scratch and check that the
# second build installed exactly the same versions. Called by .ci/run; prints its wall time.
#
# The base image is made offline-friendly with debootstrap (Debian bookworm, whose python3 is 3.11 like
# the Dockerfile's default python:3.11-slim-bookworm) and kept in buildah's storage for later runs.
# The build reaches the package registry through this machine's CA bundle, lent to the RUN steps as a
# build-time volume, and finds the CPU torch wheel in a local folder (WHEELS); neither is in the image.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
WHEELS=${WHEELS:-/opt/wheels}
BASE=localhost/debian-py:bookworm
IMAGE=localhost/qlora-kit:ci
store=(--storage-driver vfs)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

if ! command -v buildah >/dev/null || ! command -v debootstrap >/dev/null; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq buildah debootstrap >/dev/null
fi

if ! buildah "${store[@]}" inspect --type image "$BASE" >/dev/null 2>&1; then
  echo "== base image: debootstrap bookworm with python3"
  debootstrap --variant=minbase --include=python3,python3-venv,python3-pip bookworm "$work/rootfs" \
    http://deb.debian.org/debian >/dev/null
  ctr=$(buildah "${store[@]}" from scratch)
  mnt=$(buildah "${store[@]}" mount "$ctr")
  cp -a "$work/rootfs/." "$mnt/"
  buildah "${store[@]}" umount "$ctr" >/dev/null
  buildah "${store[@]}" commit -q "$ctr" "$BASE" >/dev/null
  buildah "${store[@]}" rm "$ctr" >/dev/null
  rm -rf "$work/rootfs"
fi

build() {
  buildah "${store[@]}" bud --isolation chroot --pull=never --no-cache --layers=false -q \
    -v /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro \
    -v "$WHEELS:/wheels:ro" \
    --build-arg BASE_IMAGE="$BASE" \
    --build-arg LOCK_FILE=docker/requirements-cpu.lock \
    --build-arg PIP_FIND_LINKS=/wheels \
    -t "$IMAGE" . >/dev/null
}

installed() {  # the image's installed packages, as name==version lines
  local ctr
  ctr=$(buildah "${store[@]}" from "$IMAGE")
  buildah "${store[@]}" run --isolation chroot "$ctr" -- python -m pip list --format=freeze --exclude-editable
  buildah "${store[@]}" rm "$ctr" >/dev/null
}

echo "== build 1"
build
installed > "$work/first.txt"
python3 scripts/check_lock.py docker/requirements-cpu.lock "$work/first.txt"

echo "== the demo inside the image"
ctr=$(buildah "${store[@]}" from "$IMAGE")
buildah "${store[@]}" run --isolation chroot "$ctr" -- qlora-kit train recipes/demo.yaml --output-dir /tmp/demo \
  > "$work/demo.txt" 2>&1 || { tail -30 "$work/demo.txt"; exit 1; }
buildah "${store[@]}" rm "$ctr" >/dev/null
# the summary table's row and the last line (tests/e2e/test_cli.py checks the demo prints both)
for line in "eval loss, first -> best -> last" "adapter written to /tmp/demo"; do
  grep -F "$line" "$work/demo.txt" || { tail -30 "$work/demo.txt"; echo "the demo printed no '$line'" >&2; exit 1; }
done

echo "== build 2, from scratch"
build
installed > "$work/second.txt"
if ! diff -u "$work/first.txt" "$work/second.txt"; then
  echo "the second build installed different versions" >&2
  exit 1
fi
echo "second build: the same $(wc -l < "$work/second.txt") packages and versions"

buildah "${store[@]}" rmi "$IMAGE" >/dev/null 2>&1 || true
echo "image build, demo and checks took $(( $(date +%s) - start )) s"
