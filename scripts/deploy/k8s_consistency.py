#!/usr/bin/env python3
"""Checks that a rendered Kubernetes overlay (deploy/kubernetes/<overlay>) and the topology
in its ConfigMap describe the same cluster, which no schema can see:

- the ConfigMap tessera-topology holds topology.toml, which every StatefulSet mounts;
- the coordinator StatefulSet has one replica per [[coordinator]]; peer n is pod
  tessera-coordinator-<n-1>, its host's address that pod's DNS name in the StatefulSet's
  headless Service, its quic and http ports the container's;
- each [[group]] has a StatefulSet of its name with tp replicas, TESSERA_GROUP set to it,
  rank r on host <group>-<r> at <group>-<r>.<service>, its port the container's
  collective port, a GPU per pod exactly when the group runs on cuda; and no StatefulSet
  is left over;
- the Services those names rely on are headless and publish pods before they are ready;
- coordinators probe /health (liveness, startup) and /ready (readiness); every pod runs as
  a non-root user; every model path lies on the models volume.

Usage: kubectl kustomize DIR | k8s_consistency.py NAME TOPOLOGY_OUT
(writes the ConfigMap's topology to TOPOLOGY_OUT for `tessera topology check`). Prints
every problem and exits 1 when there is one.
"""

import sys
import tomllib

import yaml

COORDINATOR_STS = "tessera-coordinator"


def main() -> int:
    name, topology_out = sys.argv[1], sys.argv[2]
    docs = [d for d in yaml.safe_load_all(sys.stdin) if d]
    problems: list[str] = []

    def problem(text: str) -> None:
        problems.append(f"{name}: {text}")

    by_kind: dict[str, dict[str, dict]] = {}
    for d in docs:
        by_kind.setdefault(d["kind"], {})[d["metadata"]["name"]] = d
    configmaps = [n for n in by_kind.get("ConfigMap", {}) if n.startswith("tessera-topology")]
    if len(configmaps) != 1:
        problem(f"expected one ConfigMap tessera-topology*, found {configmaps}")
        return report(problems)
    configmap = configmaps[0]
    text = by_kind["ConfigMap"][configmap].get("data", {}).get("topology.toml")
    if text is None:
        problem(f"ConfigMap {configmap} has no key topology.toml")
        return report(problems)
    with open(topology_out, "w", encoding="utf-8") as f:
        f.write(text)
    topology = tomllib.loads(text)
    hosts = {h["name"]: h["address"] for h in topology.get("host", [])}
    services = by_kind.get("Service", {})
    statefulsets = dict(by_kind.get("StatefulSet", {}))

    def check_sts(sts: dict, replicas: int) -> tuple[dict, str]:
        sname = sts["metadata"]["name"]
        spec = sts["spec"]
        if spec.get("replicas") != replicas:
            problem(f"StatefulSet {sname} has replicas {spec.get('replicas')}; the topology needs {replicas}")
        if spec.get("podManagementPolicy") != "Parallel":
            problem(f"StatefulSet {sname} must start its pods in parallel (podManagementPolicy: Parallel)")
        service = spec.get("serviceName", "")
        svc = services.get(service)
        if svc is None:
            problem(f"StatefulSet {sname}: its serviceName {service!r} is not a Service of the overlay")
        elif svc["spec"].get("clusterIP") != "None" or not svc["spec"].get("publishNotReadyAddresses"):
            problem(f"Service {service} must be headless (clusterIP: None) with publishNotReadyAddresses: true")
        pod = spec["template"]["spec"]
        if not pod.get("securityContext", {}).get("runAsNonRoot"):
            problem(f"StatefulSet {sname}: the pod must set runAsNonRoot: true")
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        topo_volume = volumes.get("topology", {}).get("configMap", {}).get("name")
        if topo_volume != configmap:
            problem(f"StatefulSet {sname}: volume `topology` must be the ConfigMap {configmap}, not {topo_volume}")
        container = pod["containers"][0]
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        mounts = {m["name"]: m["mountPath"] for m in container.get("volumeMounts", [])}
        expected = mounts.get("topology", "?") + "/topology.toml"
        if env.get("TESSERA_TOPOLOGY") != expected:
            problem(f"StatefulSet {sname}: TESSERA_TOPOLOGY is {env.get('TESSERA_TOPOLOGY')}, the mounted file is {expected}")
        if env.get("TESSERA_ORDINAL_FROM_HOSTNAME") != "1":
            problem(f"StatefulSet {sname}: TESSERA_ORDINAL_FROM_HOSTNAME must be 1 (ordinal -> peer id or rank)")
        for model in topology.get("model", []):
            if not model["path"].startswith(mounts.get("models", "?") + "/"):
                problem(f"StatefulSet {sname}: model {model['name']} at {model['path']} is not on the models volume ({mounts.get('models')})")
        return container, service

    def port(container: dict, port_name: str) -> int | None:
        for p in container.get("ports", []):
            if p.get("name") == port_name:
                return p["containerPort"]
        return None

    def check_host(what: str, host: str, want_host: str, service: str) -> None:
        if host != want_host:
            problem(f"{what} runs on host {host!r}; on Kubernetes it is pod {want_host!r}")
        address = hosts.get(host)
        if address != f"{want_host}.{service}":
            problem(f"host {host!r} has address {address!r}; the pod's DNS name is {want_host}.{service}")

    coordinators = topology.get("coordinator", [])
    sts = statefulsets.pop(COORDINATOR_STS, None)
    if sts is None:
        problem(f"no StatefulSet {COORDINATOR_STS}")
    else:
        container, service = check_sts(sts, len(coordinators))
        for c in coordinators:
            pod = f"{COORDINATOR_STS}-{c['id'] - 1}"
            check_host(f"coordinator {c['id']}", c["host"], pod, service)
            quic_host, quic_port = c["quic"].rsplit(":", 1)
            if quic_host != f"{pod}.{service}" or int(quic_port) != port(container, "quic"):
                problem(f"coordinator {c['id']}: quic {c['quic']}; the pod listens at {pod}.{service}:{port(container, 'quic')}")
            if int(c["http"].rsplit(":", 1)[1]) != port(container, "http"):
                problem(f"coordinator {c['id']}: http {c['http']}; the container's http port is {port(container, 'http')}")
        paths = {}
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            paths[kind] = container.get(kind, {}).get("httpGet", {}).get("path")
        want = {"startupProbe": "/health", "livenessProbe": "/health", "readinessProbe": "/ready"}
        if paths != want:
            problem(f"coordinator probes are {paths}; expected {want}")

    for group in topology.get("group", []):
        gname = group["name"]
        sts = statefulsets.pop(gname, None)
        if sts is None:
            problem(f"group {gname}: no StatefulSet named {gname}")
            continue
        container, service = check_sts(sts, group["tp"])
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        if env.get("TESSERA_GROUP") != gname:
            problem(f"StatefulSet {gname}: TESSERA_GROUP is {env.get('TESSERA_GROUP')!r}, not {gname!r}")
        gpus = container.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
        for shard in group.get("shard", []):
            rank = shard["rank"]
            check_host(f"group {gname} rank {rank}", shard["host"], f"{gname}-{rank}", service)
            if shard["port"] != port(container, "collective"):
                problem(f"group {gname} rank {rank}: port {shard['port']}; the container's collective port is {port(container, 'collective')}")
            cuda = shard["device"].startswith("cuda:")
            if cuda and shard["device"] != "cuda:0":
                problem(f"group {gname} rank {rank}: a pod sees its one GPU as cuda:0, not {shard['device']}")
            if cuda != (gpus is not None):
                problem(f"group {gname} rank {rank}: device {shard['device']} but the pod asks for nvidia.com/gpu {gpus}")
    for extra in statefulsets:
        problem(f"StatefulSet {extra} is neither the coordinators nor a group of the topology")
    return report(problems)


def report(problems: list[str]) -> int:
    for p in problems:
        print(f"error: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
