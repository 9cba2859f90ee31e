#!/usr/bin/env bash
# Make the Docker backend usable: install Debian's docker.io and debootstrap if missing, start
# dockerd in the background if no daemon answers, and build the sandbox image if it is missing.
# Idempotent. Needs root for the install and the image build.
set -euo pipefail
cd "$(dirname "$0")/.."
need=()
command -v dockerd >/dev/null || need+=(docker.io)
command -v debootstrap >/dev/null || need+=(debootstrap)
[ -s /usr/share/keyrings/debian-archive-keyring.gpg ] || need+=(debian-archive-keyring)  # the image build checks signatures
. scripts/apt_wait.sh
if [ ${#need[@]} -gt 0 ]; then
  echo "installing ${need[*]} (apt)"
  apt_wait update -qq
  apt_wait install -y -qq "${need[@]}" >/dev/null
fi
if ! docker info >/dev/null 2>&1; then
  echo "starting dockerd in the background (log: /tmp/stare-dockerd.log)"
  nohup dockerd >/tmp/stare-dockerd.log 2>&1 &
  for _ in $(seq 1 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null 2>&1 || { tail -5 /tmp/stare-dockerd.log >&2; echo "dockerd did not start within 60 s (log above)" >&2; exit 1; }
fi
.venv/bin/stare-agent sandbox build
