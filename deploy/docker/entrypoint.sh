#!/bin/sh
# The image's entrypoint: runs one Tessera binary, named by the first argument.
#
#   coordinator [FLAGS]   tessera-coordinator (the default command)
#   shard [FLAGS]         tessera-shard
#   tessera [ARGS]        the tessera command (certs, topology check, cluster, generate, bench)
#   anything else         run as given (a shell, for debugging)
#
# With TESSERA_ORDINAL_FROM_HOSTNAME=1 (a Kubernetes StatefulSet, whose pods are named
# <statefulset>-<ordinal>), the ordinal at the end of the host name sets the coordinator's
# peer id (ordinal + 1: Raft reserves 0) or the shard's rank (the ordinal), unless
# TESSERA_PEER or TESSERA_RANK is set already.
set -eu

ordinal() {
    # Docker and Kubernetes put HOSTNAME in a container's environment; the kernel's
    # copy otherwise.
    # shellcheck disable=SC3028
    host="${HOSTNAME:-$(cat /proc/sys/kernel/hostname)}"
    n="${host##*-}"
    case "$n" in
        '' | *[!0-9]*)
            echo "tessera-entrypoint: host name '$host' does not end in -<ordinal>" >&2
            exit 64
            ;;
    esac
    echo "$n"
}

role="${1:-coordinator}"
[ "$#" -gt 0 ] && shift
case "$role" in
    coordinator)
        if [ "${TESSERA_ORDINAL_FROM_HOSTNAME:-0}" = 1 ] && [ -z "${TESSERA_PEER:-}" ]; then
            n="$(ordinal)"
            TESSERA_PEER=$((n + 1))
            export TESSERA_PEER
        fi
        exec tessera-coordinator "$@"
        ;;
    shard)
        if [ "${TESSERA_ORDINAL_FROM_HOSTNAME:-0}" = 1 ] && [ -z "${TESSERA_RANK:-}" ]; then
            TESSERA_RANK="$(ordinal)"
            export TESSERA_RANK
        fi
        exec tessera-shard "$@"
        ;;
    tessera)
        exec tessera "$@"
        ;;
    *)
        exec "$role" "$@"
        ;;
esac
