#!/usr/bin/env bash
# Install CRIU >= 4.0 and checkpointctl for podsnap's process-level checkpoints.
#
# - If the system's `criu` is >= 4.0 and `criu check` passes, use it (what a
#   production node does: its distribution's CRIU).
# - Otherwise download Debian trixie's criu 4.x, its libraries, libcriu-dev
#   (criu-plugin.h) and checkpointctl with a *private* apt configuration (the
#   system's sources are not touched) and unpack them under PREFIX
#   (default: .deps/criu in the repository). The trixie binary needs trixie's
#   libc, so PREFIX/bin/criu is a wrapper that runs it through trixie's loader.
#
# Either way PREFIX/bin/criu and PREFIX/bin/checkpointctl exist afterwards and
# PREFIX/include has criu/criu-plugin.h. Idempotent: a stamp keyed on this
# script's content skips the work on re-runs.
set -euo pipefail
cd "$(dirname "$0")/.."

PREFIX=${PODSNAP_CRIU_PREFIX:-$PWD/.deps/criu}
STAMP=$PREFIX/.podsnap-criu
want=$(sha256sum deploy/install-criu.sh | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && [ -x "$PREFIX/bin/criu" ]; then
  exit 0
fi

LIBS=(criu libcompel1 libc6 libprotobuf-c1 libnl-3-200 libnet1 libgnutls30t64 libbsd0 libnftables1
      libnftnl11 libmnl0 libxtables12 libjansson4 libmd0 libedit2 libtinfo6 libgcc-s1 libzstd1 libuuid1
      libdrm2 libnettle8t64 libhogweed6t64 libunistring5 libp11-kit0 libtasn1-6 libgmp10 libidn2-0 libffi8)
DEV=(libcriu-dev checkpointctl)

# The Debian mirror this machine already uses, from its own apt sources.
debian_mirror() {
  local f
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] || continue
    awk '/^URIs:/ {uri=$2} /^Suites:/ && / bookworm( |$)|: *bookworm( |$)/ {print uri; exit}' "$f"
  done | head -n1
  grep -hE '^deb [^ ]+ bookworm main' /etc/apt/sources.list 2>/dev/null | awk '{print $2}' | head -n1 || true
}

system_criu_ok() {
  command -v criu >/dev/null 2>&1 || return 1
  local v
  v=$(criu --version 2>/dev/null | awk '/Version:/ {print $2}')
  [ "${v%%.*}" -ge 4 ] 2>/dev/null || return 1
  criu check >/dev/null 2>&1
}

mkdir -p "$PREFIX/bin" "$PREFIX/include"
chmod 0755 "$PREFIX"

APT_DIR=$PREFIX/apt
mirror=$(debian_mirror | head -n1)
if [ -z "$mirror" ]; then
  echo "error: no Debian mirror found in /etc/apt/sources.list*; cannot download trixie's criu" >&2
  exit 1
fi
mkdir -p "$APT_DIR/lists/partial" "$APT_DIR/cache/archives/partial" "$APT_DIR/debs"
echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror trixie main" > "$APT_DIR/sources.list"
apt_private=(-o "Dir::Etc::SourceList=$APT_DIR/sources.list" -o "Dir::Etc::SourceParts=/dev/null"
             -o "Dir::State::Lists=$APT_DIR/lists" -o "Dir::Cache=$APT_DIR/cache"
             -o "Dir::State::status=/dev/null" -o "APT::Architecture=amd64" -o "Debug::NoLocking=1")
echo "==> downloading CRIU 4.x (Debian trixie) into $PREFIX"
apt-get "${apt_private[@]}" -qq update
if system_criu_ok; then
  echo "==> system criu $(criu --version | awk '/Version:/ {print $2}') passes 'criu check'; using it"
  (cd "$APT_DIR/debs" && apt-get "${apt_private[@]}" -qq download "${DEV[@]}")
  ln -sf "$(command -v criu)" "$PREFIX/bin/criu"
else
  (cd "$APT_DIR/debs" && apt-get "${apt_private[@]}" -qq download "${LIBS[@]}" "${DEV[@]}")
fi
rm -rf "$PREFIX/root"
for deb in "$APT_DIR"/debs/*.deb; do dpkg -x "$deb" "$PREFIX/root"; done
cp -r "$PREFIX/root/usr/include/criu" "$PREFIX/include/"

ROOT=$PREFIX/root
LIBPATH="$ROOT/usr/lib/x86_64-linux-gnu:$ROOT/lib/x86_64-linux-gnu"
# wrap NAME BINARY: PREFIX/bin/NAME runs a trixie binary through trixie's own loader and libraries
wrap() {
  cat > "$PREFIX/bin/$1" <<EOF
#!/bin/sh
# trixie's $1, run through trixie's loader and libraries (installed by deploy/install-criu.sh)
exec "$ROOT/usr/lib64/ld-linux-x86-64.so.2" --library-path "$LIBPATH" "$2" "\$@"
EOF
  chmod 0755 "$PREFIX/bin/$1"
}
[ -L "$PREFIX/bin/criu" ] || wrap criu "$ROOT/usr/sbin/criu"
wrap checkpointctl "$ROOT/usr/bin/checkpointctl"

"$PREFIX/bin/criu" --version | head -n1
if ! "$PREFIX/bin/criu" check >/dev/null 2>&1; then
  echo "warning: 'criu check' fails on this kernel; run '$PREFIX/bin/criu check' for the reason" >&2
fi
"$PREFIX/bin/checkpointctl" version 2>/dev/null | head -n1 || true
rm -rf "$APT_DIR/cache" "$APT_DIR/lists"
echo "$want" > "$STAMP"
echo "==> CRIU ready: $PREFIX/bin/criu"
