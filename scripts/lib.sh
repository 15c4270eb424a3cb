# shellcheck shell=bash
# Helpers shared by scripts/test.sh and scripts/bench.sh; sourced, not run.

# Each step with the time it starts (UTC), so that a log shows where a run's time goes.
step() { printf '\n==> %s [%s]\n' "$*" "$(date -u +%T)"; }

die() {
  printf 'error: %s\n' "$*" >&2
  exit 1
}

# Installs the Debian packages given as arguments unless all are already installed. Root runs
# apt-get itself; anyone else needs sudo that works without a password prompt, because these
# scripts also run unattended in CI, where a prompt would hang instead of failing.
dcmha_require_packages() {
  if ! command -v dpkg >/dev/null 2>&1; then
    printf 'note: no dpkg here, so not checking packages; this needs: %s\n' "$*" >&2
    return 0
  fi
  local missing=() p
  for p in "$@"; do
    # dpkg -s also succeeds for removed packages whose config files remain; check the state.
    if ! dpkg -s "$p" 2>/dev/null | grep -q '^Status: install ok installed'; then
      missing+=("$p")
    fi
  done
  [ "${#missing[@]}" -eq 0 ] && return 0

  local sudo=()
  if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
      sudo=(sudo -n)
    else
      printf 'error: missing Debian packages: %s\n' "${missing[*]}" >&2
      printf 'Install them as root, e.g.:\n  apt-get update && apt-get install -y %s\n' \
        "${missing[*]}" >&2
      exit 1
    fi
  fi
  step "installing Debian packages: ${missing[*]}"
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive \
    apt-get install -y --no-install-recommends "${missing[@]}"
}
