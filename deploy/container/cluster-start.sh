#!/bin/sh
# Start one process of a dpstream Bytewax cluster (installed as dpstream-cluster-start).
#
# The process id (-i) is the pod's ordinal, read from POD_NAME = "$DPSTREAM_STATEFULSET-<n>";
# the addresses (-a) name every process of the cluster, in ordinal order, as
# "$DPSTREAM_STATEFULSET-<n>.$DPSTREAM_SERVICE:$DPSTREAM_CLUSTER_PORT" (the StatefulSet's stable
# DNS names under its headless Service; without DPSTREAM_SERVICE, "$DPSTREAM_STATEFULSET-<n>").
# dpstream serves metrics on metrics.port + process id; every pod has its own address, so the
# wrapper lowers the base by the ordinal and every pod serves on DPSTREAM_POD_METRICS_PORT, the
# port named in the pod template's scrape annotation.
#
# Required: POD_NAME DPSTREAM_STATEFULSET DPSTREAM_PROCESSES DPSTREAM_WORKERS
#           DPSTREAM_FLOW_MODULE DPSTREAM_RECOVERY_DIR DPSTREAM_POD_METRICS_PORT
# Optional: DPSTREAM_SERVICE, DPSTREAM_CLUSTER_PORT (2101), DPSTREAM_SNAPSHOT_SECONDS (5),
#           DPSTREAM_BACKUP_SECONDS (0)
set -eu

fail() {
    echo "dpstream-cluster-start: error: $*" >&2
    exit 2
}

is_count() {
    case "$1" in '' | *[!0-9]* | 0*) return 1 ;; *) return 0 ;; esac
}

: "${POD_NAME:?POD_NAME must be set (downward API: metadata.name)}"
: "${DPSTREAM_STATEFULSET:?DPSTREAM_STATEFULSET must be set}"
: "${DPSTREAM_FLOW_MODULE:?DPSTREAM_FLOW_MODULE must be set, e.g. dpstream.flows.counters:flow}"
: "${DPSTREAM_RECOVERY_DIR:?DPSTREAM_RECOVERY_DIR must be set (the recovery store)}"
processes="${DPSTREAM_PROCESSES:-}"
workers="${DPSTREAM_WORKERS:-}"
metrics_port="${DPSTREAM_POD_METRICS_PORT:-}"
cluster_port="${DPSTREAM_CLUSTER_PORT:-2101}"
is_count "$processes" || fail "DPSTREAM_PROCESSES must be a positive integer, got '$processes'"
is_count "$workers" || fail "DPSTREAM_WORKERS must be a positive integer, got '$workers'"
is_count "$cluster_port" || fail "DPSTREAM_CLUSTER_PORT must be a port, got '$cluster_port'"

ordinal="${POD_NAME#"$DPSTREAM_STATEFULSET"-}"
[ "$ordinal" != "$POD_NAME" ] || fail "pod name '$POD_NAME' does not start with '$DPSTREAM_STATEFULSET-'"
[ "$ordinal" = 0 ] || is_count "$ordinal" || fail "pod name '$POD_NAME' does not end in an ordinal"
[ "$ordinal" -lt "$processes" ] || fail "pod ordinal $ordinal is not below DPSTREAM_PROCESSES=$processes: scale the StatefulSet by changing both together (docs/deploy.md)"
is_count "$metrics_port" && [ "$metrics_port" -gt "$ordinal" ] \
    || fail "DPSTREAM_POD_METRICS_PORT must be a port above the ordinal, got '$metrics_port'"

addresses=""
i=0
while [ "$i" -lt "$processes" ]; do
    host="$DPSTREAM_STATEFULSET-$i${DPSTREAM_SERVICE:+.$DPSTREAM_SERVICE}"
    addresses="${addresses:+$addresses;}$host:$cluster_port"
    i=$((i + 1))
done

export DPSTREAM_METRICS_PORT=$((metrics_port - ordinal))
exec python -m bytewax.run "$DPSTREAM_FLOW_MODULE" \
    -w "$workers" -i "$ordinal" -a "$addresses" \
    -r "$DPSTREAM_RECOVERY_DIR" -s "${DPSTREAM_SNAPSHOT_SECONDS:-5}" -b "${DPSTREAM_BACKUP_SECONDS:-0}"
