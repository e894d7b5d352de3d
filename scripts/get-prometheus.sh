#!/usr/bin/env bash
# Put a Prometheus server (Debian package `prometheus`) into DEST/bin for the tests.
#
#   bash scripts/get-prometheus.sh DEST      # prints DEST/bin/prometheus
#
# The tests start their own server on 127.0.0.1 with a temporary config; this only makes
# the binaries (prometheus, promtool) available. It unpacks the .deb instead of
# `apt-get install`, because installing the package starts a system-wide daemon on :9090
# and needs root; unpacking needs neither. A second run finds DEST/bin and returns at once.
set -euo pipefail
dest="${1:?usage: get-prometheus.sh DEST}"
if [ -x "$dest/bin/prometheus" ] && [ -x "$dest/bin/promtool" ]; then
  echo "$dest/bin/prometheus"; exit 0
fi
mkdir -p "$dest/bin"
if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
  ln -sf "$(command -v prometheus)" "$dest/bin/prometheus"
  ln -sf "$(command -v promtool)" "$dest/bin/promtool"
  echo "$dest/bin/prometheus"; exit 0
fi
for tool in apt-get dpkg-deb; do
  command -v "$tool" >/dev/null 2>&1 || {
    echo "get-prometheus.sh: '$tool' not found; install Prometheus (Debian/Ubuntu: apt-get install prometheus) and put prometheus and promtool on PATH" >&2
    exit 1; }
done
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
cd "$tmp"
if ! apt-get download prometheus >"$tmp/apt.log" 2>&1; then
  # A fresh machine may have no package lists yet; only root can fetch them.
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq >>"$tmp/apt.log" 2>&1 || true
  fi
  apt-get download prometheus >>"$tmp/apt.log" 2>&1 || {
    echo "get-prometheus.sh: could not download the Debian package 'prometheus':" >&2
    tail -5 "$tmp/apt.log" >&2
    echo "get-prometheus.sh: run 'apt-get update' as root, or install prometheus and promtool on PATH" >&2
    exit 1; }
fi
dpkg-deb -x prometheus_*.deb "$tmp/root"
install -m 0755 "$tmp/root/usr/bin/prometheus" "$tmp/root/usr/bin/promtool" "$dest/bin/"
"$dest/bin/prometheus" --version >/dev/null
echo "$dest/bin/prometheus"
