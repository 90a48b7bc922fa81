#!/bin/sh
# The image's HEALTHCHECK. A coordinator is healthy while its GET /health answers 200
# (TESSERA_HEALTH_URL, default http://127.0.0.1:8000/health: the topology's `http` must
# then listen on 0.0.0.0 or 127.0.0.1). A shard serves no HTTP: it is healthy while it runs,
# and the coordinator's /ready says whether its group can generate.
set -eu
case "$(cat /proc/1/comm 2>/dev/null || true)" in
    tessera-coordin*)  # comm holds the first 15 characters of the name
        exec curl --fail --silent --show-error --output /dev/null --max-time 4 \
            "${TESSERA_HEALTH_URL:-http://127.0.0.1:8000/health}"
        ;;
    *)
        exit 0
        ;;
esac
