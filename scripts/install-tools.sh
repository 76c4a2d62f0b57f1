#!/usr/bin/env bash
# Installs the native tools smr needs into a project-local prefix, without
# touching the system's apt sources: CRIU 4.2 from Debian forky (testing),
# nats-server 2.10 and kustomize 5.6 from Debian trixie. Idempotent: a finished
# install is a no-op.
#
# Why CRIU 4.2: bookworm's 3.17 fails `criu check` on 6.x kernels with a
# vvar_vclock mapping, and 4.1 cannot dump any process holding an INET socket
# on Linux 6.16+ ("sockets: Can't get 1:16 opt": the kernel refuses SO_PASSCRED
# on INET sockets; fixed upstream in 4.2, criu#2705/#2711). See shared/NOTES.md.
set -euo pipefail

PREFIX=${SMR_TOOLS:-$(cd "$(dirname "$0")/.." && pwd)/.tools}
MIRROR=${SMR_DEBIAN_MIRROR:-http://deb.debian.org/debian}
ROOT=$PREFIX/root
STAMP=$PREFIX/.installed-v3
CRIU_MIN=4.2

# From the system's own (bookworm) sources: containerd and runc for the node
# agent's container tests, iptables-restore for CRIU's network lock, nft to undo
# that lock when a final checkpoint cannot be stored (smr/process/netlock.py), busybox
# for test images, gcc to build smr-init (and, with binutils' readelf, the
# test programs of tests/test_liveenv.py), git and make for the fresh-clone test
# (tests/test_fresh_clone.py), and redis-server, PostgreSQL 15,
# Node.js and a JDK, programs nobody here wrote, that the socket and program
# tests checkpoint (tests/programs; setpriv, util-linux's, drops them to a user).
# Each check names the program the tests run (java and javac both: an image's
# own javac elsewhere must not skip the java the tests find on PATH);
# tests/test_setup_covers_tests.py holds the tests to this list.
NEED=""
for pair in containerd:containerd runc:runc iptables-restore:iptables busybox:busybox-static \
            gcc:gcc readelf:binutils nsenter:util-linux redis-server:redis-server dpkg-source:dpkg-dev nft:nftables \
            node:nodejs java:default-jre-headless javac:default-jdk-headless \
            git:git make:make; do
  command -v "${pair%%:*}" >/dev/null || NEED="$NEED ${pair#*:}"
done
[[ -f /usr/lib/x86_64-linux-gnu/libc.a ]] || NEED="$NEED libc6-dev"
[[ -x /usr/lib/postgresql/15/bin/postgres ]] || NEED="$NEED postgresql-15"
if [[ -n $NEED ]]; then
  echo "smr: installing$NEED from the system's apt sources"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $NEED >/dev/null
  # Debian starts a system-wide redis on install; the tests start their own.
  if [[ $NEED == *redis-server* ]] && command -v systemctl >/dev/null; then
    systemctl disable --now redis-server >/dev/null 2>&1 || true
  fi
  # Likewise its PostgreSQL cluster (port 5432): the tests initdb their own.
  if [[ $NEED == *postgresql-15* ]] && command -v systemctl >/dev/null; then
    systemctl disable --now postgresql >/dev/null 2>&1 || true
  fi
fi

# cJSON's source (Debian's package, with its patches) for smr-runtime, a static
# binary that edits OCI bundles on the host (services/agent/init/smr-runtime.c).
CJSON=$PREFIX/src/cjson
if [[ ! -f $CJSON/cJSON.c ]]; then
  S=$PREFIX/src/apt
  mkdir -p "$S/lists/partial" "$S/cache/archives/partial" "$S/get"
  printf 'Types: deb-src\nURIs: %s\nSuites: bookworm\nComponents: main\nSigned-By: %s\n' \
    "$MIRROR" /usr/share/keyrings/debian-archive-keyring.gpg > "$S/bookworm-src.sources"
  SO=(-o Dir::Etc::SourceList=/dev/null -o "Dir::Etc::SourceParts=$S" -o "Dir::State::Lists=$S/lists"
      -o "Dir::Cache=$S/cache" -o APT::Sandbox::User=root)
  apt-get "${SO[@]}" -qq update
  (cd "$S/get" && apt-get "${SO[@]}" -qq source --download-only cjson \
     && dpkg-source --no-check -x ./*.dsc "$S/get/tree" >/dev/null)
  mkdir -p "$CJSON" && cp "$S/get/tree/cJSON.c" "$S/get/tree/cJSON.h" "$S/get/tree/LICENSE" "$CJSON/"
  rm -rf "$S"
fi

# Prometheus and promtool (bookworm's, unpacked, never installed as a service):
# the metrics tests scrape smr with the real server, and promtool checks and
# unit-tests the alert rules under deploy/observability.
if [[ ! -x $PREFIX/bin/prometheus || ! -x $PREFIX/bin/promtool ]]; then
  P=$PREFIX/prometheus
  rm -rf "$P" && mkdir -p "$P/deb" "$PREFIX/bin"
  (cd "$P/deb" && apt-get -qq -o APT::Sandbox::User=root download prometheus)
  dpkg -x "$P"/deb/prometheus_*.deb "$P/root" && rm -rf "$P/deb"
  ln -sf "$P/root/usr/bin/prometheus" "$PREFIX/bin/prometheus"
  ln -sf "$P/root/usr/bin/promtool" "$PREFIX/bin/promtool"
  "$PREFIX/bin/promtool" --version | head -1
fi

# containerd 1.7 (trixie) and 2.x (forky), their binaries only, never run as a
# service: the installer's tests load the config it writes with each release
# (tests/test_install.py); the system's 1.6 runs the containers.
CTD=$PREFIX/containerd
if [[ ! -x $CTD/1.7/containerd || ! -x $CTD/2/containerd ]]; then
  A=$CTD/apt
  rm -rf "$A" && mkdir -p "$A/lists/partial" "$A/cache/archives/partial" "$A/get" "$CTD/1.7" "$CTD/2"
  for suite in trixie forky; do
    printf 'Types: deb\nURIs: %s\nSuites: %s\nComponents: main\nSigned-By: %s\n' \
      "$MIRROR" "$suite" /usr/share/keyrings/debian-archive-keyring.gpg > "$A/$suite.sources"
  done
  CO=(-o Dir::Etc::SourceList=/dev/null -o "Dir::Etc::SourceParts=$A" -o "Dir::State::Lists=$A/lists"
      -o "Dir::Cache=$A/cache" -o Dir::Etc::Preferences=/dev/null
      -o Dir::Etc::PreferencesParts=/dev/null -o Dir::State::status=/dev/null
      -o APT::Architecture=amd64 -o APT::Architectures=amd64 -o APT::Sandbox::User=root)
  apt-get "${CO[@]}" -qq update
  (cd "$A/get" && apt-get "${CO[@]}" -qq download containerd/trixie containerd/forky)
  for deb in "$A"/get/containerd_*.deb; do
    case $(dpkg-deb -f "$deb" Version) in 1.7.*) d=1.7 ;; 2.*) d=2 ;; *) continue ;; esac
    dpkg-deb --fsys-tarfile "$deb" | tar -xO ./usr/bin/containerd > "$CTD/$d/containerd"
    chmod +x "$CTD/$d/containerd"
  done
  rm -rf "$A"
  "$CTD/1.7/containerd" --version && "$CTD/2/containerd" --version
fi

if [[ -f $STAMP && -x $PREFIX/bin/criu && -x $PREFIX/bin/nats-server && -x $PREFIX/bin/kustomize ]]; then
  touch "$STAMP"
  exit 0
fi

echo "smr: installing CRIU $CRIU_MIN+ (Debian forky), nats-server 2.10 and kustomize 5.6 (trixie) into $PREFIX"
# A stale prefix (an older CRIU) is replaced whole: its libraries must not mix in.
rm -rf "$ROOT" "$PREFIX/debs" "$PREFIX/apt" "$PREFIX"/.installed-v[0-9]*
mkdir -p "$PREFIX/apt/lists/partial" "$PREFIX/apt/cache/archives/partial" "$PREFIX/debs" "$ROOT" "$PREFIX/bin"
for suite in trixie forky; do
  cat > "$PREFIX/apt/$suite.sources" <<SRC
Types: deb
URIs: $MIRROR
Suites: $suite
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
done
O=(-o Dir::Etc::SourceList=/dev/null -o "Dir::Etc::SourceParts=$PREFIX/apt"
   -o "Dir::State::Lists=$PREFIX/apt/lists" -o "Dir::Cache=$PREFIX/apt/cache"
   -o Dir::Etc::Preferences=/dev/null -o Dir::Etc::PreferencesParts=/dev/null
   -o Dir::State::status=/dev/null
   -o APT::Architecture=amd64 -o APT::Architectures=amd64 -o APT::Sandbox::User=root)
apt-get "${O[@]}" -qq update
# CRIU and every library it links against, as apt resolves them today (the
# newest suite wins), so a renamed library (libnet1 -> libnet9) needs no edit here.
mapfile -t CRIU_PKGS < <(apt-cache "${O[@]}" depends --recurse --no-recommends --no-suggests \
  --no-conflicts --no-breaks --no-replaces --no-enhances criu | grep -v '^[ <]' | sort -u)
(cd "$PREFIX/debs" && apt-get "${O[@]}" -qq download "${CRIU_PKGS[@]}" nats-server/trixie kustomize/trixie)
for f in "$PREFIX"/debs/*.deb; do dpkg -x "$f" "$ROOT"; done

# criu needs a newer glibc than bookworm's: start it through the prefix's own loader.
L=$ROOT/usr/lib/x86_64-linux-gnu
cat > "$PREFIX/bin/criu" <<W
#!/bin/sh
exec "$L/ld-linux-x86-64.so.2" --library-path "$L" "$ROOT/usr/sbin/criu" "\$@"
W
chmod +x "$PREFIX/bin/criu"
# nats-server and kustomize are static Go binaries.
ln -sf "$ROOT/usr/sbin/nats-server" "$PREFIX/bin/nats-server"
ln -sf "$ROOT/usr/bin/kustomize" "$PREFIX/bin/kustomize"

version=$("$PREFIX/bin/criu" --version | sed -n 's/^Version: *//p')
if [[ $(printf '%s\n' "$CRIU_MIN" "$version" | sort -V | head -1) != "$CRIU_MIN" ]]; then
  echo "smr: Debian served CRIU $version, older than $CRIU_MIN; set SMR_DEBIAN_MIRROR to a mirror with forky" >&2
  exit 1
fi
echo "CRIU $version"
"$PREFIX/bin/criu" check
"$PREFIX/bin/nats-server" --version
"$PREFIX/bin/kustomize" version
touch "$STAMP"
