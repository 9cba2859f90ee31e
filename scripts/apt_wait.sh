# Sourced by scripts/setup_docker.sh (and tests/repo/test_setup_scripts.py).
# apt-get "$@", waiting (at most APT_LOCK_WAIT_S, default 600 s, saying so) while another package
# manager (unattended-upgrades, a second setup) holds apt's or dpkg's lock, instead of failing at once.
apt_wait() {
  local limit=${APT_LOCK_WAIT_S:-600} start out
  start=$(date +%s)
  while true; do
    if out=$(DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=10 "$@" 2>&1); then return 0; fi
    if ! grep -qiE "could not get lock|unable to acquire|is another process using it" <<<"$out"; then
      echo "$out" >&2; return 1
    fi
    if [ $(( $(date +%s) - start )) -ge "$limit" ]; then
      echo "$out" >&2
      echo "another package manager held the apt lock for over ${limit} s: let it finish (or stop it), then run this again" >&2
      return 1
    fi
    echo "another package manager holds the apt lock: waiting for it ($(( $(date +%s) - start )) s of at most ${limit} s)" >&2
    sleep 5
  done
}
