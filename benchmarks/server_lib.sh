# Sourced by the benchmark scripts that start servers: SERVER is the pid (and process group)
# of the one running; stop_server ends it and every child it started.
SERVER=""
stop_server() {
  [ -n "$SERVER" ] || return 0
  kill -TERM -- "-$SERVER" 2>/dev/null || true
  for _ in $(seq 100); do kill -0 "$SERVER" 2>/dev/null || break; sleep 0.1; done
  kill -KILL -- "-$SERVER" 2>/dev/null || true  # the group: no child outlives the run
  wait "$SERVER" 2>/dev/null || true
  SERVER=""
}
