#!/usr/bin/env bash
# The whole check: lint, Django checks, migrations, gRPC stubs, then the test suite.
# Uses a Redis at REDIS_URL (default database 15 of 127.0.0.1:6379), starting a local one
# if none answers; DATABASE_URL selects PostgreSQL, SQLite otherwise.
set -euo pipefail
PY=${1:-.venv/bin/python}
BIN=$(dirname "$PY")
cd "$(dirname "$0")/.."
export LLAMAFLEET_SECRET_KEY=${LLAMAFLEET_SECRET_KEY:-test-secret-key-not-for-production}
export LLAMAFLEET_NODE_TOKEN=${LLAMAFLEET_NODE_TOKEN:-test-node-token}
export REDIS_URL=${REDIS_URL:-redis://127.0.0.1:6379/15}
export LLAMAFLEET_VAR_DIR=${LLAMAFLEET_VAR_DIR:-$PWD/var/test}

redis_host_port=$(echo "$REDIS_URL" | sed -E 's#redis://([^:/]+):?([0-9]*).*#\1 \2#')
read -r rhost rport <<<"$redis_host_port"
rport=${rport:-6379}
if ! (exec 3<>"/dev/tcp/$rhost/$rport" && printf 'PING\r\n' >&3 && head -c5 <&3 | grep -q PONG) 2>/dev/null; then
  echo "Starting a local Redis on $rhost:$rport for the tests"
  mkdir -p var
  redis-server --daemonize yes --bind 127.0.0.1 --port "$rport" --save "" --appendonly no \
    --dir "$PWD/var" --pidfile "$PWD/var/redis-test.pid" --logfile "$PWD/var/redis-test.log"
  sleep 0.5
fi

# The console's browser tests drive Debian's chromium (Playwright's own download has no host
# to come from here); the deploy tests check docker-compose.yml with Debian's docker-compose;
# the fault battery cuts a split's link with iptables (skipped where it cannot be installed).
for tool in chromium docker-compose iptables; do
  if ! command -v "$tool" >/dev/null && [ ! -x "/usr/sbin/$tool" ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      echo "Installing Debian's $tool for the tests"
      export DEBIAN_FRONTEND=noninteractive
      apt-get install -y -q "$tool" >/dev/null \
        || { apt-get update -q >/dev/null && apt-get install -y -q "$tool" >/dev/null; } \
        || [ "$tool" = iptables ]
    elif [ "$tool" = iptables ]; then
      echo "Without iptables the fault battery skips its link cut: sudo apt-get install iptables"
    else
      echo "The tests need /usr/bin/$tool: sudo apt-get install $tool" >&2
      exit 1
    fi
  fi
done

echo "== lint"
"$BIN/ruff" check .
"$BIN/ruff" format --check .
echo "== yaml"
"$BIN/yamllint" --strict -c .yamllint deploy docker-compose.yml
echo "== django checks"
"$PY" manage.py check --fail-level WARNING
"$PY" manage.py makemigrations --check --dry-run
echo "== gRPC stubs"
scripts/check_proto.sh "$PY"
echo "== engine build"
"$PY" scripts/check_engine.py
echo "== tests"
exec "$PY" -m pytest "${@:2}"
