#!/usr/bin/env bash
# Build the sandbox image without any registry: debootstrap a minimal Debian, add Python with
# ipykernel/numpy/sympy/scipy and tini, strip caches, `docker import` the tree.
# Usage: build.sh TAG [SUITE] [MIRROR]        (run as root; needs debootstrap and a Docker daemon)
# Every package is signature-checked: debootstrap against Debian's archive keyring (fails closed
# without it: STARE_DEBIAN_KEYRING overrides its path), apt inside the tree against the keyring
# that debootstrap installed. The image has no setuid/setgid files and carries its package list
# in /etc/stare-sandbox/packages.txt.
set -euo pipefail
tag=${1:?usage: build.sh TAG [SUITE] [MIRROR]}
suite=${2:-bookworm}
mirror=${3:-http://deb.debian.org/debian}
keyring=${STARE_DEBIAN_KEYRING:-/usr/share/keyrings/debian-archive-keyring.gpg}
# The kernel's uid and gid inside the container: outside the range of login users (UID_MAX 60000)
# so that it cannot be the host user's: the first of stare_sandbox.config.SANDBOX_UIDS (each sandbox
# runs as a uid of its own from that range and binds its own /etc/passwd naming it).
uid=61000
[ -s "$keyring" ] || { echo "Debian archive keyring $keyring not found: apt-get install -y debian-archive-keyring (packages are never installed unverified)" >&2; exit 2; }
command -v debootstrap >/dev/null || { echo "debootstrap not found: apt-get install -y debootstrap" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "building the sandbox image needs root (debootstrap + chroot): rerun with sudo" >&2; exit 2; }

work=$(mktemp -d /tmp/stare-image.XXXXXX)
root="$work/rootfs"
cleanup() { umount -l "$root/proc" 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT

# Stage 1: a bare minbase system. Stage 2: the Python packages with apt inside the chroot
# (with /proc mounted and no recommends), which configures reliably where --include does not.
debootstrap --force-check-gpg --keyring="$keyring" --variant=minbase "$suite" "$root" "$mirror" >"$work/debootstrap.log" 2>&1 || {
  tail -20 "$work/debootstrap.log" >&2; echo "debootstrap failed (see above): check that $mirror is reachable" >&2; exit 1; }
mount -t proc proc "$root/proc"
cp /etc/resolv.conf "$root/etc/resolv.conf" 2>/dev/null || true
pkgs="python3 python3-ipykernel python3-numpy python3-sympy python3-scipy tini"
chroot "$root" /usr/bin/env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $pkgs \
  >"$work/apt.log" 2>&1 || { tail -20 "$work/apt.log" >&2; echo "apt-get inside the image failed (see above)" >&2; exit 1; }
chroot "$root" apt-get clean
# Import everything once now so that a broken image fails the build, not an episode.
chroot "$root" /usr/bin/python3 -c "import ipykernel, numpy, sympy, scipy; print('ok')" >/dev/null 2>&1 || {
  echo "the image cannot import its kernel packages" >&2; exit 1; }
umount -l "$root/proc"
: > "$root/etc/resolv.conf"

# Unprivileged user the kernel runs as; /work is the writable tmpfs work dir, /conn the
# bind-mounted directory with the connection file and ipc sockets.
chroot "$root" /usr/sbin/useradd --uid "$uid" --user-group --home-dir /work --no-create-home --shell /usr/sbin/nologin sandbox
# /work is root's with mode 1777 (Docker gives the tmpfs mounted there the image dir's mode): the
# kernel can fill it, not mark the root itself (extended attributes, times, flags, its mode)
# for the next episode to read.
mkdir -p "$root/work" "$root/conn"
chmod 1777 "$root/work"
# Test suites of numpy/scipy/sympy are about a third of the image and never imported by a kernel.
find "$root/usr/lib/python3/dist-packages" -depth -type d -name tests -exec rm -rf {} +
# Precompile bytecode (the root fs is read-only at run time) and drop what a kernel never needs.
# Bookworm's python3-scipy depends on python3-pythran, which drags in a C++ toolchain, Boost
# headers and -dev packages (~500 MB) that scipy never uses at run time: drop them (the import
# check below proves scipy still loads).
build_only="python3-pythran python3-all-dev python3-dev python3.11-dev libpython3-all-dev libpython3-dev
  libpython3.11-dev libboost1.74-dev libboost-dev libxsimd-dev gcc-12 g++-12 cpp-12 gcc g++ cpp
  libstdc++-12-dev libgcc-12-dev libc6-dev linux-libc-dev libc-dev-bin libcrypt-dev libnsl-dev libtirpc-dev
  rpcsvc-proto libopenblas-dev libopenblas-pthread-dev libblas-dev liblapack-dev binutils binutils-common
  binutils-x86-64-linux-gnu libbinutils libctf0 libctf-nobfd0 libgprofng0 libasan8 libtsan2 liblsan0
  libubsan1 libhwasan0 libitm1 libcc1-0 libisl23 libjs-jquery libjs-underscore libjs-sphinxdoc gdb
  libexpat1-dev zlib1g-dev"
installed=$(chroot "$root" dpkg-query -W -f='${Package}\n' $build_only 2>/dev/null || true)
[ -n "$installed" ] && chroot "$root" dpkg --purge --force-depends $installed >/dev/null 2>&1
chroot "$root" /usr/bin/python3 -m compileall -q /usr/lib/python3 >/dev/null 2>&1 || true
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/usr/share/doc/* \
       "$root"/usr/share/man/* "$root"/usr/share/info/* "$root"/usr/share/locale/* "$root"/var/log/*
# No setuid/setgid programs (su, mount, passwd, ...): nothing in the image can gain privileges,
# even where no-new-privileges were not set. Checked, so that a missed one fails the build.
find "$root" -xdev -type f -perm /6000 -exec chmod ug-s {} +
left=$(find "$root" -xdev -type f -perm /6000)
[ -z "$left" ] || { echo "setuid/setgid files left in the image: $left" >&2; exit 1; }
# The installed packages, with versions, recorded in the image itself.
mkdir -p "$root/etc/stare-sandbox"
chroot "$root" dpkg-query -W -f='${Package}\t${Version}\t${Architecture}\n' | sort > "$root/etc/stare-sandbox/packages.txt"
# Import everything once now so that a broken image fails the build, not an episode.
chroot "$root" /usr/bin/python3 -c "import ipykernel, ipykernel.kernelapp, numpy, sympy, scipy.optimize, scipy.stats, scipy.linalg, scipy.integrate, scipy.special; print('ok')" >/dev/null

tar -C "$root" -c . | docker import \
  --change 'ENTRYPOINT ["/usr/bin/tini", "--"]' \
  --change "USER $uid:$uid" \
  --change 'WORKDIR /work' \
  --change 'ENV HOME=/work PYTHONDONTWRITEBYTECODE=1 MPLCONFIGDIR=/work/.mpl PYDEVD_DISABLE_FILE_VALIDATION=1' \
  --change 'LABEL org.stare-agent.sandbox=1' \
  - "$tag" >/dev/null
echo "built $tag"
