#!/usr/bin/env bash
# Debian packages varcomm's transports, tests and benchmarks use. Installs only
# what is missing, and only as root; otherwise says what to install.
set -euo pipefail
pkgs=(pkg-config g++ libfabric-dev libfabric-bin openmpi-bin libopenmpi-dev iproute2)
missing=()
for p in "${pkgs[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
  echo "varcomm: optional system packages missing: ${missing[*]} (install them as root for rdma and the MPI baseline)" >&2
  exit 0
fi
echo "varcomm: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q >/dev/null
apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
