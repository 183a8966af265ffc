#!/usr/bin/env bash
# Best-effort system packages: WordNet (METEOR), Chromium (PNG export, page tests) and PostgreSQL (the replica tests).
# Needs apt-get and root; elsewhere it says what is missing and carries on.
set -u
need=()
[ -f /usr/share/wordnet/data.noun ] || need+=(wordnet-base)
[ -f /usr/share/wordnet/index.sense ] || need+=(wordnet-sense-index)
command -v chromium >/dev/null 2>&1 || need+=(chromium)
compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || need+=(postgresql)
[ ${#need[@]} -eq 0 ] && exit 0
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "installing system packages: ${need[*]}"
  apt-get update -qq >/dev/null 2>&1 || true
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null 2>&1 \
    || echo "warning: apt-get install ${need[*]} failed; METEOR/PNG/browser features and the PostgreSQL tests will say so"
else
  echo "note: system packages missing (${need[*]}); install them for METEOR, PNG export, browser and PostgreSQL tests"
fi
exit 0
