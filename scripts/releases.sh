# Sourced by the set-up and test scripts: reads requirements/releases.conf.
releases_conf="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/requirements/releases.conf"

# All releases, default first.
release_names() { awk '!/^#/ && NF {print $1}' "$releases_conf"; }

# release_row RELEASE: sets REL_PYTHON REL_MCORE REL_NVRX REL_LOCK REL_VENV (empty RELEASE: the default).
release_row() {
  local want=${1:-$(release_names | head -n 1)} row
  row=$(awk -v r="$want" '!/^#/ && $1 == r' "$releases_conf")
  if [ -z "$row" ]; then
    echo "unknown Megatron-Bridge release '$want'; known: $(release_names | tr '\n' ' ')(requirements/releases.conf)" >&2
    return 2
  fi
  read -r REL_BRIDGE REL_PYTHON REL_MCORE REL_NVRX REL_LOCK REL_VENV <<<"$row"
}
