"""The helper script every exec of the Docker layer runs inside a sandbox, as the container's user.

One bash script, passed as the exec's argv (``bash -c SCRIPT toren ACTION ARGS...``), so a
sandbox image needs nothing of Toren's: bash 4.4 or later, GNU coreutils (timeout, head, wc,
realpath, stat, mkfifo, mkdir, mv, rm, chmod, cat, env) and GNU tar on its PATH. Caller-given
text (the command, paths) only ever arrives as arguments, never in the script's text.

A command's record lives in ``/run/toren/<marker>.*`` (a tmpfs of its own, so it goes with the
container): ``started``; ``wrapper`` and ``pid`` (the wrapper's pid and the command's process
group, which GNU timeout makes its own); ``oom`` (the memory cgroup's OOM-kill count before);
``out`` (the first ``cap`` bytes of stdout and stderr merged); ``rest`` (how many bytes came
after the cap: drained and counted, never stored, so the command never sees SIGPIPE);
``timeout`` (what timeout --verbose said: not empty when the time limit killed the command);
``exit`` (written last, atomically: exit status, timed out, OOM-kill count after).

``report`` prints a record: one status line on stderr, ``toren STATE EXIT TIMED OOM REST``
(STATE finished, interrupted or not_started; EXIT ``-`` when unknown) and the stored output on
stdout. Exit statuses of the script: 0 done; 3 path outside the workspace or not a regular file;
4 no such file; 5 is a directory; 6 not a directory; 97 marker used before; other: a failure
whose reason is on stderr.
"""

SCRIPT = r"""
set -u
dir=/run/toren
ws=/workspace

oom_kills() {
  local f key value
  for f in /sys/fs/cgroup/memory/memory.oom_control /sys/fs/cgroup/memory.events; do
    [[ -r $f ]] || continue
    while read -r key value; do
      if [[ $key == oom_kill ]]; then echo "$value"; return; fi
    done <"$f"
  done
  echo 0
}

has_marker() {  # $1 pid, $2 marker (empty: any); true if its environment carries it
  local e
  local -a env=()
  mapfile -t -d '' env <"/proc/$1/environ" 2>/dev/null || return 1
  for e in "${env[@]}"; do
    [[ $e == TOREN_COMMAND=* ]] || continue
    [[ -z $2 || $e == "TOREN_COMMAND=$2" ]] && return 0
  done
  return 1
}

kill_marked() {  # $1 marker (empty: any), $2 a pid to spare; kills the others, prints how many
  local n=0 pid
  for pid in /proc/[0-9]*; do
    pid=${pid#/proc/}
    [[ $pid == "$$" || $pid == "$BASHPID" || $pid == "${2:-}" ]] && continue
    if has_marker "$pid" "$1" && kill -KILL "$pid" 2>/dev/null; then n=$((n + 1)); fi
  done
  echo "$n"
}

own_group() {  # the helper's process group (field 5 of /proc/self/stat, after the name)
  local stat rest
  read -r stat </proc/$$/stat
  rest=${stat##*) }
  read -r _ _ group _ <<<"$rest"
  echo "$group"
}

parent_of() {  # $1 pid: its parent's pid, from /proc (bash only: no awk in a user's image)
  local key value
  while read -r key value; do
    [[ $key == PPid: ]] && { echo "$value"; return 0; }
  done <"/proc/$1/status" 2>/dev/null
  return 1
}

kill_strays() {  # kills what hides from marker and group (setsid, env -i): prints how many
  # A process that descends from an exec (a running helper, whose parent is outside the
  # container: 0) is spared, as are init (1) and the container's main process (init's first
  # child). Whatever else hangs from init was left behind by a command: a daemon.
  local n=0 pid up ppid main=
  for pid in /proc/[0-9]*; do  # the lowest pid: glob order is not numeric order
    pid=${pid#/proc/}
    [[ $(parent_of "$pid") == 1 ]] && { [[ -z $main ]] || ((pid < main)); } && main=$pid
  done
  for pid in /proc/[0-9]*; do
    pid=${pid#/proc/}
    [[ $pid == 1 || $pid == "$main" ]] && continue
    up=$pid
    while ppid=$(parent_of "$up") && [[ $ppid != 0 && $ppid != 1 ]]; do up=$ppid; done
    [[ ${ppid:-} == 1 && $up != "$main" ]] || continue
    kill -KILL "$pid" 2>/dev/null && n=$((n + 1))
  done
  echo "$n"
}

kill_command() {  # $1 marker: kills a command still running, prints how many processes
  local p=$dir/$1 n=0 k pass pid
  [[ -e $p.started && ! -e $p.exit ]] || { echo 0; return; }
  # The wrapper first, so that it cannot record the kill as the command's exit.
  if read -r pid <"$p.wrapper" 2>/dev/null && has_marker "$pid" "$1"; then
    kill -KILL "$pid" 2>/dev/null && n=$((n + 1))
  fi
  for ((pass = 0; pass < 50; pass++)); do
    k=$(kill_marked "$1"); n=$((n + k))
    # The group catches what dropped the marker from its environment. A pid is not reused while
    # its group has members, so a group with no leader left is still this command's.
    # A record is the command's to write: only a group that is not 1 (everything) nor the
    # helper's own is killed.
    if read -r pid <"$p.pid" 2>/dev/null && [[ $pid =~ ^[1-9][0-9]*$ && $pid != 1 ]] \
      && [[ $pid != "$(own_group)" ]]; then
      [[ ! -e /proc/$pid ]] || has_marker "$pid" "$1" && kill -KILL -- "-$pid" 2>/dev/null
    fi
    ((k == 0)) && break
  done
  echo "$n"
}

drained() {  # $1 marker: waits (2 s at most) for a killed command's reader to store its output
  local p=$dir/$1 tick i
  [[ -e $p.started && ! -e $p.exit ]] || return 0
  # The reader (head) writes what it holds when its last writer is gone, then its count.
  [[ -p $dir/.tick ]] || mkfifo -m 0600 "$dir/.tick" 2>/dev/null
  exec {tick}<>"$dir/.tick"
  for ((i = 0; i < 200; i++)); do
    [[ -s $p.rest ]] && break
    read -r -t 0.01 -u "$tick"
  done
  exec {tick}>&-
}

report() {
  local p=$dir/$1 state=not_started rc=- timed=0 oom0=0 oom1=0 rest=0
  if [[ -e $p.exit ]]; then
    state=finished
    read -r rc timed oom1 <"$p.exit"
  elif [[ -e $p.started ]]; then
    state=interrupted
  fi
  [[ -r $p.oom ]] && read -r oom0 <"$p.oom"
  [[ -s $p.rest ]] && read -r rest <"$p.rest"
  [[ $state == finished ]] || oom1=$oom0
  printf 'toren %s %s %s %s %s\n' "$state" "$rc" "$timed" "$((oom1 > oom0))" "$rest" >&2
  [[ -r $p.out ]] && cat -- "$p.out"
  return 0
}

run() {  # marker cap limit grace command
  local m=$1 cap=$2 limit=$3 grace=$4 cmd=$5 p=$dir/$1 reader group tick i rc timed=0
  [[ -d $dir ]] || mkdir -p -m 0700 "$dir" || exit 90
  if [[ -e $p.started ]]; then echo "marker $m was used before" >&2; exit 97; fi
  oom_kills >"$p.oom"
  echo "$$" >"$p.wrapper"
  printf '%(%s)T\n' -1 >"$p.started"
  mkfifo -m 0600 "$p.fifo" || exit 91
  # The reader drops the marker: killing a command's processes leaves it to drain and count.
  # (Until it has exec'd env and bash, its environment is still the wrapper's.)
  env -u TOREN_COMMAND bash -c 'head -c "$1" >"$2.out"; wc -c >"$2.rest"' reader "$cap" "$p" \
    <"$p.fifo" &
  reader=$!
  (
    echo "$BASHPID" >"$p.pid"
    exec timeout --verbose --kill-after="$grace" "$limit" \
      bash -c 'exec bash -c "$1" 2>&1' toren "$cmd" </dev/null >"$p.fifo" 2>"$p.timeout"
  ) &
  group=$!
  wait "$group"
  rc=$?
  # The command is over when its first process is: what it left behind goes with it.
  kill -KILL -- "-$group" 2>/dev/null
  kill_marked "$m" "$reader" >/dev/null
  kill_strays >/dev/null
  # The reader ends when the last writer does; one that escaped group and marker gets 10 s.
  # (A fifo nobody writes, held open both ways, makes read -t a sleep that forks nothing.)
  [[ -p $dir/.tick ]] || mkfifo -m 0600 "$dir/.tick" 2>/dev/null
  exec {tick}<>"$dir/.tick"
  for ((i = 0; i < 1000; i++)); do
    kill -0 "$reader" 2>/dev/null || break
    read -r -t 0.01 -u "$tick"
  done
  exec {tick}>&-
  kill -KILL "$reader" 2>/dev/null
  wait "$reader"
  [[ -s $p.timeout ]] && timed=1
  echo "$rc $timed $(oom_kills)" >"$p.exit.tmp" && mv -f "$p.exit.tmp" "$p.exit"
  rm -f "$p.fifo"
  report "$m"
}

resolve() {  # sets r to the real path of $1 under the workspace, or exits 3
  [[ -n $1 ]] || set -- .
  r=$(cd "$ws" && realpath -m -- "$1") || exit 1
  case $r in
    "$ws" | "$ws"/*) ;;
    *) echo "$1 resolves to $r, outside $ws" >&2; exit 3 ;;
  esac
}

exists() {
  [[ -e $r ]] || { echo "$1: no such file or directory" >&2; exit 4; }
}

read_file() {  # path cap
  resolve "$1"; exists "$1"
  [[ -d $r ]] && { echo "$1 is a directory" >&2; exit 5; }
  [[ -f $r ]] || { echo "$1 is not a regular file" >&2; exit 3; }
  echo "size $(stat -c %s -- "$r")" >&2
  head -c "$2" -- "$r"
}

write_file() {  # path size; the content on stdin
  local parent tmp
  resolve "$1"
  [[ -d $r ]] && { echo "$1 is a directory" >&2; exit 5; }
  [[ -e $r && ! -f $r ]] && { echo "$1 is not a regular file" >&2; exit 3; }
  parent=${r%/*}
  [[ -e $parent && ! -d $parent ]] && { echo "${parent#"$ws"/} is not a directory" >&2; exit 6; }
  mkdir -p -- "$parent" || exit 6
  tmp=$parent/.toren-write.$$
  if ! cat >"$tmp"; then rm -f -- "$tmp"; exit 1; fi
  # A stream cut short reads as an early end-of-file: only the whole content replaces the file.
  if [[ $(stat -c %s -- "$tmp") != "$2" ]]; then
    echo "received $(stat -c %s -- "$tmp") of $2 bytes" >&2; rm -f -- "$tmp"; exit 1
  fi
  [[ -e $r ]] && chmod --reference="$r" -- "$tmp"
  mv -f -- "$tmp" "$r" || { rm -f -- "$tmp"; exit 1; }
}

list_files() {  # path recursive limit; NUL-separated type, size, path triples on stdout
  local -a names=()
  local n
  resolve "$1"; exists "$1"
  shopt -s nullglob dotglob
  if [[ ! -d $r ]]; then
    names=("$r")
  elif [[ $2 == 1 ]]; then
    shopt -s globstar
    names=("$r"/**)
    [[ ${#names[@]} -gt 0 && ${names[0]} == "$r/" ]] && names=("${names[@]:1}")
  else
    names=("$r"/*)
  fi
  n=${#names[@]}
  echo "total $n" >&2
  ((n > 0)) || return 0
  stat --printf '%F\0%s\0%n\0' -- "${names[@]:0:$3}"
}

readable() {  # what a command made unreadable (chmod 000) must not break a checkpoint
  chmod -R u+rwX -- "$ws" 2>/dev/null
}

clear_workspace() {
  shopt -s nullglob dotglob
  local -a all=("$ws"/*)
  readable
  ((${#all[@]} == 0)) || rm -rf -- "${all[@]}"
}

action=$1
shift
# Byte order and untranslated stat output for the helper's own actions; a command keeps its locale.
[[ $action == run ]] || export LC_ALL=C
case $action in
  run) run "$@" ;;
  report) report "$1" ;;
  recover) kill_command "$1" >/dev/null; drained "$1"; report "$1" ;;
  kill_all)
    total=0
    for f in "$dir"/*.started; do
      [[ -e $f ]] || continue
      m=${f##*/}; m=${m%.started}
      total=$((total + $(kill_command "$m")))
    done
    for ((pass = 0; pass < 50; pass++)); do
      k=$(kill_marked ""); total=$((total + k))
      ((k == 0)) && break
    done
    total=$((total + $(kill_strays)))
    echo "$total"
    ;;
  # The record goes, but not .started: a marker runs at most once in a container, whatever a
  # stalled worker that lost its lease may still try.
  forget) for f in "$dir/$1".*; do [[ $f == *.started ]] || rm -f -- "$f"; done ;;
  read) read_file "$@" ;;
  # Docker ends an exec with stdin only when the client's input has all been read: drain it.
  write) (write_file "$@"); status=$?; cat >/dev/null; exit "$status" ;;
  list) list_files "$@" ;;
  export)  # cap: the most bytes of files the workspace may hold (a sparse file holds more)
    readable
    size=$(du -sb --apparent-size -- "$ws" | cut -f1)
    if ((size > $1)); then
      echo "the workspace holds $size bytes of files (sparse files count whole), over $1" >&2
      exit 8
    fi
    tar -C "$ws" --sort=name --numeric-owner -cf - .
    ;;
  import)
    [[ $1 == 1 ]] && clear_workspace
    tar -C "$ws" -xpf - --no-same-owner
    status=$?
    cat >/dev/null
    exit "$status"
    ;;
  *) echo "unknown action $action" >&2; exit 2 ;;
esac
"""
