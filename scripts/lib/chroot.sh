# Shared by the scripts that run things in a Debian root made with debootstrap
# (scripts/ci/in-debian13.sh, scripts/release/deb-check.sh). Source it after setting CHROOT_TAG (the
# script's name, for messages). It provides:
#   fail MSG...                        print "<tag>: FAILED: MSG" and exit 1
#   $SUDO                              "sudo" unless already root
#   $DEBOOTSTRAP                       debootstrap's path (installed when missing)
#   mount_in ROOT TYPE SOURCE TARGET   a mount inside ROOT, undone by cleanup
#   mount_system ROOT                  /proc, /dev, /dev/pts, /dev/shm, /sys, resolv.conf
#   cleanup                            unmounts everything mounted here, newest first;
#                                      installed as the EXIT trap
#   remove_root DIR                    deletes a root made here, unmounting leftovers first
#   debootstrap_root SUITE DIR LOG [debootstrap options...]
#                                      a minbase root of SUITE in DIR, the host's apt settings
#                                      copied in; the mirror is FSDP_DEBIAN_MIRROR if set
# shellcheck shell=bash

fail() { echo "${CHROOT_TAG}: FAILED: $*" >&2; exit 1; }
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || fail "this needs root (or sudo) to run debootstrap, mount and chroot"
  SUDO="sudo"
fi
if ! command -v debootstrap >/dev/null && [ ! -x /usr/sbin/debootstrap ]; then
  echo "[${CHROOT_TAG}] installing debootstrap"
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq debootstrap >/dev/null ||
    fail "debootstrap is not installed and could not be installed (apt-get install debootstrap)"
fi
DEBOOTSTRAP="$(command -v debootstrap || echo /usr/sbin/debootstrap)"

MOUNTS=()
cleanup() {
  local i
  for ((i = ${#MOUNTS[@]} - 1; i >= 0; i--)); do
    $SUDO umount "${MOUNTS[$i]}" 2>/dev/null || $SUDO umount -l "${MOUNTS[$i]}" 2>/dev/null ||
      echo "${CHROOT_TAG}: warning: could not unmount ${MOUNTS[$i]}" >&2
  done
  MOUNTS=()
}
trap cleanup EXIT
trap 'exit 130' INT TERM
mount_in() {  # mount_in ROOT TYPE SOURCE TARGET [OPTIONS]
  local root="$1" type="$2" src="$3" tgt="$1$4"
  $SUDO mkdir -p "$tgt"
  if [ "$type" = bind ]; then
    $SUDO mount --bind "$src" "$tgt" || fail "cannot bind-mount $src at $tgt (is mount permitted here?)"
  else
    $SUDO mount -t "$type" "$src" "$tgt" || fail "cannot mount $type at $tgt (is mount permitted here?)"
  fi
  MOUNTS+=("$tgt")
}
mount_system() {  # /proc, /dev (with its own /dev/shm), /dev/pts, /sys and a resolver for apt
  local root="$1"
  mount_in "$root" proc proc /proc
  mount_in "$root" bind /dev /dev
  mount_in "$root" bind /dev/pts /dev/pts
  mount_in "$root" tmpfs tmpfs /dev/shm
  mount_in "$root" bind /sys /sys
  $SUDO cp -L /etc/resolv.conf "$root/etc/resolv.conf" 2>/dev/null || true
}
# Removes a root made here. A run killed with SIGKILL leaves its mounts behind (the
# host's /dev, the project): those are unmounted first, and rm never leaves the root's
# own file system, so nothing outside the root can be deleted.
remove_root() {
  local dir="$1" m
  [ -e "$dir" ] || return 0
  while read -r m; do
    [ -n "$m" ] && [ "$m" != "$dir" ] && { $SUDO umount "$m" 2>/dev/null || $SUDO umount -l "$m"; }
  done < <(awk -v d="$dir" '$5 == d || index($5, d "/") == 1 {print $5}' /proc/self/mountinfo | sort -r)
  $SUDO rm -rf --one-file-system "$dir"
}
debootstrap_root() {  # debootstrap_root SUITE DIR LOG [debootstrap options...]
  local suite="$1" dir="$2" log="$3" t0=$SECONDS
  shift 3
  echo "[${CHROOT_TAG}] debootstrap $suite into $dir (about a minute)"
  # shellcheck disable=SC2086
  if ! $SUDO "$DEBOOTSTRAP" --variant=minbase "$@" "$suite" "$dir" ${FSDP_DEBIAN_MIRROR:-} 2>&1 |
       $SUDO tee "$log" >/dev/null; then
    tail -20 "$log" >&2
    fail "debootstrap $suite failed (log: $log)"
  fi
  echo "[${CHROOT_TAG}] debootstrap took $((SECONDS - t0)) s"
  # The host's apt settings (proxies, validity checks of snapshot mirrors) apply inside too.
  $SUDO cp -n /etc/apt/apt.conf.d/* "$dir/etc/apt/apt.conf.d/" 2>/dev/null || true
}
