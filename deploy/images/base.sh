#!/usr/bin/env bash
# The base every image in deploy/images/ builds on, made here when it is missing:
#   deploy/images/base.sh servemesh-base:bookworm
# A tag named servemesh-base:* is made locally, without a registry: debootstrap a minimal
# Debian bookworm (Python 3.11, venv, CA certificates, libseccomp2) and `docker import` it.
# Any other tag (python:3.11-slim, debian:bookworm-slim) is pulled from its registry.
# Needs root and debootstrap for the local base; about 40 s and 275 MB of disk while it runs.
set -euo pipefail
tag="${1:?usage: base.sh TAG}"
docker="${DOCKER:-docker}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"

if "$docker" image inspect "$tag" >/dev/null 2>&1; then
    exit 0
fi
case "$tag" in
    servemesh-base:*) ;;
    *) exec "$docker" pull "$tag" ;;
esac
if ! command -v debootstrap >/dev/null 2>&1; then
    echo "error: debootstrap is needed to make $tag (apt-get install debootstrap)" >&2
    exit 1
fi

root="$(mktemp -d "${TMPDIR:-/tmp}/servemesh-base.XXXXXX")"
trap 'rm -rf "$root"' EXIT
echo "making $tag: debootstrap bookworm from $mirror"
debootstrap --variant=minbase \
    --include=python3,python3-venv,ca-certificates,libseccomp2 \
    bookworm "$root" "$mirror" >"$root.log" 2>&1 \
    || { tail -20 "$root.log" >&2; rm -f "$root.log"; exit 1; }
rm -f "$root.log"
# As Docker's own Debian images do: packages installed in a build never start their
# daemons (no init runs there), apt keeps no package files or lists in a layer, and the
# root carries no host name, machine id or caches of this machine.
printf '#!/bin/sh\nexit 101\n' >"$root/usr/sbin/policy-rc.d"
chmod 0755 "$root/usr/sbin/policy-rc.d"
cat >"$root/etc/apt/apt.conf.d/docker-clean" <<'APT'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache ""; Dir::Cache::srcpkgcache "";
APT
printf 'Acquire::Languages "none";\n' >"$root/etc/apt/apt.conf.d/docker-no-languages"
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb \
    "$root"/var/log/* "$root"/tmp/* "$root"/etc/hostname "$root"/etc/machine-id
: >"$root/etc/machine-id"
tar --numeric-owner -C "$root" -c . \
    | "$docker" import \
        --change 'ENV LANG=C.UTF-8' \
        --change 'CMD ["/bin/bash"]' \
        - "$tag" >/dev/null
echo "made $tag"
