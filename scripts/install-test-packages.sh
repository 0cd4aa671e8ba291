#!/usr/bin/env bash
# Installs the Debian packages the test suite needs, when they are missing (run by `make test`
# through `make test-packages`, so a fresh machine needs no step of its own):
# - cmake, ninja, g++: tests/realengine builds llama.cpp's llama-server from source (cached after
#   the first build, see scripts/build-llama-server.sh);
# - promtool (Debian's prometheus package): checks the Prometheus alert rules
#   (tests/deploy/test_alert_rules.py);
# - openssl: makes the self-signed certificates of the TLS tests (tests/gateway/tls_certs.py);
# - redis-server (brings redis-cli through redis-tools): the shared-store tests start real Redis
#   servers, replica pairs and clusters on loopback (tests/store/redis_servers.py);
# - chromium: the dashboard test opens /dashboard in headless Chromium, driven over the DevTools
#   protocol (tests/dashboard/).
# Needs apt-get and root (or passwordless sudo) only when something is missing.
set -euo pipefail
packages=()
for tool in cmake:cmake ninja:ninja-build g++:g++ promtool:prometheus openssl:openssl redis-server:redis-server chromium:chromium; do
  command -v "${tool%%:*}" >/dev/null || packages+=("${tool#*:}")
done
((${#packages[@]})) || exit 0
sudo=
if [[ $(id -u) -ne 0 ]]; then
  command -v sudo >/dev/null || {
    echo "install-test-packages: missing ${packages[*]} and not root: apt-get install ${packages[*]}" >&2
    exit 2
  }
  sudo=sudo
fi
echo "install-test-packages: apt-get install ${packages[*]}" >&2
$sudo apt-get update -qq
$sudo apt-get install -y -qq "${packages[@]}" >/dev/null
