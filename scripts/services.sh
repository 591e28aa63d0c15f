#!/usr/bin/env bash
# Start the local services the tests use (PostgreSQL, Redis) if they are not already running.
set -euo pipefail
if ! pg_isready -h 127.0.0.1 -p 5432 -q 2>/dev/null; then
  if [ -d /etc/postgresql ]; then
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -1)" main start
  else
    echo "PostgreSQL is not running and no cluster is installed: apt-get install -y postgresql" >&2
    exit 1
  fi
  for _ in $(seq 30); do pg_isready -h 127.0.0.1 -p 5432 -q && break; sleep 1; done
fi
if ! (command -v redis-cli >/dev/null && redis-cli -h 127.0.0.1 ping >/dev/null 2>&1); then
  if ! command -v redis-server >/dev/null; then
    apt-get update -qq && apt-get install -y -qq redis-server >/dev/null
  fi
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no
fi
