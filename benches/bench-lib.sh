# The start-up the shell benchmarks share; sourced, after `cd` to the repo
# root. Builds fencegate and the proxy bench, makes a scratch directory
# ($work) that goes on exit with every process in $pids, starts the minimal
# backend of benches/proxy.rs ($backend: host:port), and defines
# start_fencegate.

# The bench target first: building it builds the binary again with the
# dev-dependencies' features (the test-util feature plants the core's
# mutant checks), and the release build after it puts the binary users run
# back in target/release (cargo keeps both; neither is linked again).
cargo bench --bench proxy --no-run --quiet 2>/dev/null
cargo build --release --quiet
bench=$(ls -t target/release/deps/proxy-* | grep -v '\.d$' | head -1)
# shellcheck source=benches/scratch.sh
source benches/scratch.sh

"$bench" --kv-backend >"$work/backend.out" &
pids+=($!)
for _ in $(seq 100); do [[ -s "$work/backend.out" ]] && break; sleep 0.1; done
backend=$(head -1 "$work/backend.out")

# start_fencegate WRAPPER [NAME=value ...]: `fencegate serve` with one worker
# thread in front of the backend, under WRAPPER (a command prefix such as
# valgrind's, or empty) with the given environment; sets $fencegate (its
# pid) and $fg_addr (host:port) once it is ready (at once standalone; in
# cluster mode once this member is primary).
start_fencegate() {
    local wrapper=$1
    shift
    rm -f "$work/fencegate.out"
    # $wrapper is split into words on purpose.
    # shellcheck disable=SC2086
    env FENCEGATE_LOG=warn FENCEGATE_RUNTIME__WORKER_THREADS=1 "$@" $wrapper \
        target/release/fencegate serve --listen 127.0.0.1:0 \
        --upstream "http://$backend" --data-dir "$work/data" \
        >"$work/fencegate.out" 2>"$work/fencegate.log" &
    fencegate=$!
    pids+=("$fencegate")
    for _ in $(seq 600); do grep -q listening "$work/fencegate.out" 2>/dev/null && break; sleep 0.1; done
    fg_addr=$(sed -n 's|^fencegate listening on http://||p' "$work/fencegate.out")
    for _ in $(seq 600); do curl -sf "http://$fg_addr/_fence/readyz" >/dev/null && break; sleep 0.1; done
}
