#!/usr/bin/env bash
# Installs the native tools smr needs into a project-local prefix, without
# touching the system's apt sources: CRIU 4.1, nats-server 2.10 and kustomize 5.6
# from Debian trixie (bookworm's criu 3.17 fails on kernels >= 6.x with a vvar_vclock
# mapping, see shared/NOTES.md). Idempotent: a finished install is a no-op.
set -euo pipefail

PREFIX=${SMR_TOOLS:-$(cd "$(dirname "$0")/.." && pwd)/.tools}
MIRROR=${SMR_DEBIAN_MIRROR:-http://deb.debian.org/debian}
ROOT=$PREFIX/root
STAMP=$PREFIX/.installed-v2

# The libraries criu 4.1 links against on trixie (measured: see NOTES.md).
PKGS="criu libcompel1 libc6 libbsd0 libgnutls30t64 libnet1 libnftables1 libnl-3-200
libprotobuf-c1 libuuid1 libunistring5 libidn2-0 libp11-kit0 libtasn1-6 libnettle8t64
libhogweed6t64 libgmp10 libjansson4 libmnl0 libnftnl11 libxtables12 libedit2 libffi8
libzstd1 libbrotli1 zlib1g libmd0 libcap2 libgcc-s1 libtinfo6 libbz2-1.0 liblzma5
libxxhash0 libgpg-error0 libgcrypt20 libelf1t64 nats-server kustomize"

# From the system's own (bookworm) sources: containerd and runc for the node
# agent's container tests, iptables-restore for CRIU's network lock, busybox
# for test images, gcc to build smr-init.
NEED=""
for pair in containerd:containerd runc:runc iptables-restore:iptables busybox:busybox-static \
            gcc:gcc nsenter:util-linux; do
  command -v "${pair%%:*}" >/dev/null || NEED="$NEED ${pair#*:}"
done
[[ -f /usr/lib/x86_64-linux-gnu/libc.a ]] || NEED="$NEED libc6-dev"
if [[ -n $NEED ]]; then
  echo "smr: installing$NEED from the system's apt sources"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $NEED >/dev/null
fi

if [[ -f $STAMP && -x $PREFIX/bin/criu && -x $PREFIX/bin/nats-server && -x $PREFIX/bin/kustomize ]]; then
  touch "$STAMP"
  exit 0
fi

echo "smr: installing CRIU 4.1 and nats-server 2.10 from Debian trixie into $PREFIX"
mkdir -p "$PREFIX/apt/lists/partial" "$PREFIX/apt/cache/archives/partial" "$PREFIX/debs" "$ROOT" "$PREFIX/bin"
cat > "$PREFIX/apt/trixie.sources" <<SRC
Types: deb
URIs: $MIRROR
Suites: trixie
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
O=(-o Dir::Etc::SourceList=/dev/null -o "Dir::Etc::SourceParts=$PREFIX/apt"
   -o "Dir::State::Lists=$PREFIX/apt/lists" -o "Dir::Cache=$PREFIX/apt/cache"
   -o Dir::Etc::Preferences=/dev/null -o Dir::Etc::PreferencesParts=/dev/null
   -o APT::Architecture=amd64 -o APT::Architectures=amd64 -o APT::Sandbox::User=root)
apt-get "${O[@]}" -qq update
# shellcheck disable=SC2086
(cd "$PREFIX/debs" && apt-get "${O[@]}" -qq download $PKGS)
for f in "$PREFIX"/debs/*.deb; do dpkg -x "$f" "$ROOT"; done

# criu needs trixie's glibc: start it through the prefix's own loader.
L=$ROOT/usr/lib/x86_64-linux-gnu
cat > "$PREFIX/bin/criu" <<W
#!/bin/sh
exec "$L/ld-linux-x86-64.so.2" --library-path "$L" "$ROOT/usr/sbin/criu" "\$@"
W
chmod +x "$PREFIX/bin/criu"
# nats-server is a static Go binary.
ln -sf "$ROOT/usr/sbin/nats-server" "$PREFIX/bin/nats-server"
# kustomize 5.6 (static Go) renders deploy/kustomize in the tests.
ln -sf "$ROOT/usr/bin/kustomize" "$PREFIX/bin/kustomize"

"$PREFIX/bin/criu" --version
"$PREFIX/bin/nats-server" --version
"$PREFIX/bin/kustomize" version
touch "$STAMP"
