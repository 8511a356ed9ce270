# Sourced by .ci/run: start_postgres starts a private PostgreSQL server (Debian's `postgresql` package, installed
# with apt-get if missing) in a temporary folder, listening on 127.0.0.1 only, creates the role and database
# `varscope` and exports VARSCOPE_PG_URL; the server is stopped when the calling shell exits. It never fails the
# caller: on any problem it returns 1 with the reason in VARSCOPE_PG_SKIP (the PostgreSQL tests then skip).
start_postgres() {
  export VARSCOPE_PG_SKIP=""
  if [ -n "${VARSCOPE_PG_URL:-}" ]; then return 0; fi  # given by the caller (e.g. a CI service)
  local bin
  bin=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)
  if [ -z "$bin" ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    (DEBIAN_FRONTEND=noninteractive timeout 300 apt-get install -y -q --no-install-recommends postgresql \
       >/dev/null 2>&1 || { timeout 120 apt-get update -q >/dev/null 2>&1 &&
       DEBIAN_FRONTEND=noninteractive timeout 300 apt-get install -y -q --no-install-recommends postgresql \
       >/dev/null 2>&1; }) || true
    bin=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)
  fi
  if [ -z "$bin" ]; then VARSCOPE_PG_SKIP="the Debian postgresql package is not installed and apt-get could not install it"; return 1; fi
  local as=()  # the server refuses to run as root: run it as the postgres user then
  if [ "$(id -u)" = 0 ]; then
    if ! id postgres >/dev/null 2>&1; then VARSCOPE_PG_SKIP="running as root without a postgres user"; return 1; fi
    as=(runuser -u postgres --)
  fi
  local dir port
  dir=$(mktemp -d /tmp/varscope-pg.XXXXXX) && chmod 755 "$dir"
  [ "$(id -u)" = 0 ] && chown postgres "$dir"
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  if ! "${as[@]}" "$bin/initdb" -D "$dir/data" -A trust -U postgres --no-sync >"$dir/initdb.log" 2>&1; then
    VARSCOPE_PG_SKIP="initdb failed (see $dir/initdb.log)"; return 1
  fi
  if ! "${as[@]}" "$bin/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 60 \
       -o "-c listen_addresses=127.0.0.1 -p $port -k $dir -c fsync=off" start >/dev/null 2>&1; then
    VARSCOPE_PG_SKIP="the server did not start (see $dir/server.log)"; return 1
  fi
  VARSCOPE_PG_STOP="${as[*]} $bin/pg_ctl -D $dir/data -m fast stop; rm -rf $dir"
  trap 'eval "$VARSCOPE_PG_STOP" >/dev/null 2>&1 || true' EXIT
  if ! "${as[@]}" "$bin/psql" -h 127.0.0.1 -p "$port" -U postgres -q -v ON_ERROR_STOP=1 \
       -c "CREATE ROLE varscope LOGIN CREATEDB PASSWORD 'varscope'" -c "CREATE DATABASE varscope OWNER varscope" \
       >"$dir/psql.log" 2>&1; then
    VARSCOPE_PG_SKIP="could not create the varscope role and database (see $dir/psql.log)"; return 1
  fi
  export VARSCOPE_PG_URL="postgresql://varscope:varscope@127.0.0.1:$port/varscope"
}
