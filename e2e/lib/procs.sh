# Process handling shared by e2e/cluster.sh and e2e/node.sh (sourced, not run).
#
# Daemons are tracked by pid files and never looked up by name: `start` writes NAME.pid and
# NAME.log in $PROC_DIR, and `stop_one` stops exactly that process. The sourcing script sets:
#   PROC_DIR   folder of the pid files and logs
#   PROC_TAG   prefix of progress lines, e.g. "cluster"
#   TIMEOUT    seconds `wait_for` waits
#   COMPONENTS its daemons, in start order
# and defines `exe_of NAME`: the absolute path of NAME's executable.

log() { printf '[%s] %s\n' "$PROC_TAG" "$*" >&2; }
die() { printf '[%s] ERROR: %s\n' "$PROC_TAG" "$*" >&2; exit 1; }

# Is PID our process NAME? Guards against a pid file that outlived its process and a pid reused
# by something else. The process is either already the executable or the `bash -c ... exec`
# wrapper that is about to become it (then the path is in its argv).
is_our_process() {
  local pid="$1" want exe
  [[ "$pid" =~ ^[0-9]+$ && -d "/proc/$pid" ]] || return 1
  # A zombie has exited; it only waits to be reaped by its parent.
  [[ "$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)" != "Z" ]] || return 1
  want="$(exe_of "$2")"
  exe="$(readlink "/proc/$pid/exe" 2>/dev/null || true)"
  exe="${exe% (deleted)}" # binary replaced by a rebuild while running
  [[ "$exe" == "$want" ]] && return 0
  { tr '\0' '\n' < "/proc/$pid/cmdline"; } 2>/dev/null | grep -qxF "$want"
}

pid_of() { cat "$PROC_DIR/$1.pid" 2>/dev/null || true; }

# True when every one of COMPONENTS runs.
components_running() {
  local name
  for name in "${COMPONENTS[@]}"; do
    is_our_process "$(pid_of "$name")" "$name" || return 1
  done
}

# stop_one NAME [KILL]: stops NAME by its pid file: SIGTERM, up to 20 s, then SIGKILL; with KILL,
# SIGKILL at once (a crash: no graceful shutdown). Returns once no thread of it is left.
stop_one() {
  local name="$1" signal="${2:-TERM}" pid waited=0
  pid="$(pid_of "$name")"
  if [[ -n "$pid" ]] && is_our_process "$pid" "$name"; then
    log "stopping $name (pid $pid, SIG$signal)"
    kill "-$signal" "$pid" 2>/dev/null || true
    # A multi-threaded process shows as a zombie as soon as its main thread is gone, while other
    # threads may still hold its sockets: wait until no thread is left.
    while is_our_process "$pid" "$name" || threads_left "$pid"; do
      if ((waited == 200)); then
        log "$name (pid $pid) ignored SIGTERM for 20 s; sending SIGKILL"
        kill -KILL "$pid" 2>/dev/null || true
      fi
      ((waited < 300)) || die "$name (pid $pid) did not exit after SIGKILL"
      sleep 0.1
      waited=$((waited + 1))
    done
  fi
  rm -f "$PROC_DIR/$name.pid"
}

# True while PID has a thread that is not a zombie.
threads_left() {
  local t
  for t in /proc/"$1"/task/*/stat; do
    [[ -e "$t" ]] || continue
    [[ "$(awk '{print $3}' "$t" 2>/dev/null)" == Z ]] || return 0
  done
  return 1
}

# start NAME ARGS...: runs NAME's executable detached: its own session (a Ctrl-C or hangup of the
# caller's terminal does not reach it), stdio not inherited (a caller reading our stdout gets EOF
# when we exit), and the scripts' lock fds 8 and 9 closed (or the daemon would hold the lock for
# its whole life). The wrapper writes its own pid, then execs, so the pid file is exact.
start() {
  local name="$1"; shift
  log "starting $name (log: $PROC_DIR/$name.log)"
  # shellcheck disable=SC2016 # $$, $1 and $@ are for the inner bash
  setsid bash -c 'echo $$ > "$1"; shift; exec "$@"' _ \
    "$PROC_DIR/$name.pid" "$(exe_of "$name")" "$@" \
    </dev/null >>"$PROC_DIR/$name.log" 2>&1 8<&- 9<&- &
  local i
  for i in $(seq 50); do
    [[ -s "$PROC_DIR/$name.pid" ]] && return 0
    sleep 0.1
  done
  die "$name did not start (no pid file after 5 s)"
}

# The last lines of NAME's log on stderr, with a hint if a port was taken.
show_log() {
  local name="$1" f="$PROC_DIR/$1.log"
  [[ -f "$f" ]] || return 0
  printf '[%s] ----- last 40 lines of %s -----\n' "$PROC_TAG" "$f" >&2
  tail -n 40 "$f" >&2 || true
  printf '[%s] ----- end of %s -----\n' "$PROC_TAG" "$f" >&2
  if grep -qiE 'address already in use|bind: address' "$f"; then
    log "$name could not bind its port: port in use (see above)"
  fi
}

# wait_for NAME WHAT CMD...: polls CMD every 0.5 s until it succeeds, at most $TIMEOUT s, failing
# early if NAME's process is gone.
wait_for() {
  local name="$1" what="$2"; shift 2
  local deadline=$((SECONDS + TIMEOUT))
  until "$@" >/dev/null 2>&1; do
    if ! is_our_process "$(pid_of "$name")" "$name"; then
      show_log "$name"
      die "$name exited while waiting for $what"
    fi
    if ((SECONDS >= deadline)); then
      show_log "$name"
      die "$what: not within ${TIMEOUT} s"
    fi
    sleep 0.5
  done
}

# Prints N distinct free TCP ports on 127.0.0.1 (bound at once, so distinct, then released; the
# kernel does not hand them out again right away).
free_ports() {
  python3 - "$1" <<'EOF'
import socket, sys
socks = []
for _ in range(int(sys.argv[1])):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    socks.append(s)
print(" ".join(str(s.getsockname()[1]) for s in socks))
EOF
}
