# Sourced by the image scripts (sandbox-image, postgres-image, toren-image): a Debian root
# filesystem made by debootstrap from the apt mirror, imported as a Docker image, without any
# registry. The root filesystem is cached as a tarball under ${XDG_CACHE_HOME:-~/.cache}/toren/,
# named by suite and package list, so making the image again takes seconds, even after
# `docker system prune`; debootstrap needs root and about a minute the first time.
#
# The caller sets: docker (the client), say (a function printing "NAME: message").
# Environment: DEBIAN_MIRROR (default http://deb.debian.org/debian).

# debian_base IMAGE PACKAGES: make IMAGE (if absent) from bookworm minbase plus PACKAGES
# (comma-separated). Exits 1 with a message saying what is missing.
debian_base() {
  local image=$1 packages=$2
  local mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}" suite=bookworm
  local cache="${XDG_CACHE_HOME:-$HOME/.cache}/toren"
  local name="${image//[\/:]/-}"
  # The package list is part of the tarball's name: changing it builds a new root filesystem.
  local tarball="$cache/$name-$(printf %s "$suite:$packages" | sha256sum | cut -c1-12).tar"

  if "$docker" image inspect "$image" >/dev/null 2>&1; then
    say "base $image is present"
    return 0
  fi
  if [ ! -s "$tarball" ]; then
    if [ "$(id -u)" != 0 ]; then
      say "debootstrap needs root: run this once as root (or with sudo) to make $tarball" >&2
      exit 1
    fi
    command -v debootstrap >/dev/null || {
      say "debootstrap is missing: apt-get install debootstrap" >&2
      exit 1
    }
    local rootfs t
    rootfs="$(mktemp -d)"
    # shellcheck disable=SC2064  # expand now: the trap must remove this very directory
    trap "rm -rf '$rootfs'" EXIT
    say "debootstrap $suite ($packages) from $mirror: about a minute"
    t=$(date +%s)
    debootstrap --variant=minbase --include="$packages" "$suite" "$rootfs" "$mirror" >/dev/null
    # Package caches and lists are not needed at run time.
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    mkdir -p "$cache"
    tar -C "$rootfs" -cf "$tarball.partial" .
    mv "$tarball.partial" "$tarball"
    rm -rf "$rootfs"
    trap - EXIT
    say "root filesystem cached in $tarball ($(($(date +%s) - t))s)"
  fi
  say "importing $tarball as $image"
  "$docker" import - "$image" <"$tarball" >/dev/null
}

# need_docker: exit 1 with a message when no daemon answers.
need_docker() {
  if ! "$docker" version >/dev/null 2>&1; then
    say "no Docker daemon answers ($docker version failed): install docker.io and start dockerd" >&2
    exit 1
  fi
}
