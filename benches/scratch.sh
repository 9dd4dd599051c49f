# The scratch space the shell benchmarks share; sourced. Makes a scratch
# directory ($work) that goes on exit with every process whose pid is in
# $pids, and defines free_port (a free loopback TCP port).
work=$(mktemp -d)
pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
