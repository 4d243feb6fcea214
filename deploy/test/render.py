"""Renders deploy/k8s/base for `podman kube play --network host` (the podman tier, issue 40).

The base is what a user applies to Kubernetes. podman 4.3 (Debian bookworm) plays Pods and
Deployments with ConfigMaps, emptyDir, hostPath and persistentVolumeClaim volumes, probes and
security contexts as written; what it does not play is changed here, and only that:

- a StatefulSet becomes a Deployment (podman 4.3 ignores StatefulSets), its volumeClaimTemplates
  named volumes (`<name>-<claim>`);
- a Secret volume becomes a hostPath directory of the Secret's files (podman 4.3's Secret volume
  crashes it: a nil pointer in VolumeFromSecret); the files are written owner-readable only;
- Services and PodDisruptionBudgets are dropped (no cluster DNS nor eviction API: with host
  networking every pod shares the host's loopback), so service names become 127.0.0.1 and every
  port a free one the test chose (two gateway pods cannot both listen on 8080);
- an emptyDir becomes a named volume of its pod (`<deployment>-<volume>`): podman 4.3 names an
  emptyDir's volume after the volume alone, so two pods' `spool` would be one directory (the
  second sidecar refuses a spool another holds). Unlike an emptyDir it outlives its pod: the
  test removes it;
- containers' `ports` are dropped (podman 4.3 makes each a port mapping, refused with host
  networking: "PortMappings can only be used with Bridge or slirp4netns networking");
- images get the tier's tag;
- deadlines are generous, as in every functional test (tests/src/gateway.rs: the filter's
  sidecar.timeout 2 s; the sidecar's Redis timeouts 1 s): the tier shares two cores with image
  builds and the load generator, and a starved decision would meet a failure mode, not a bug.

Everything else — commands, environment, probes, resources, users, read-only root filesystems,
the configuration in the ConfigMaps — is played as the base has it.
"""

import copy
import os

import yaml

BASE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "k8s", "base")


def load_base():
    """Every object of the base, in kustomization.yaml's order, with its image names resolved."""
    with open(os.path.join(BASE, "kustomization.yaml")) as f:
        kust = yaml.safe_load(f)
    images = {i["name"]: i for i in kust.get("images", [])}
    objects = []
    for res in kust["resources"]:
        with open(os.path.join(BASE, res)) as f:
            for doc in yaml.safe_load_all(f):
                if doc:
                    objects.append(doc)
    return objects, images


def by_kind_name(objects):
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


class Ports:
    """The tier's ports (all on the host's loopback)."""

    def __init__(self, free):
        self.redis, self.broker, self.postgres, self.upstream, self.billing_metrics = (free() for _ in range(5))
        # per gateway pod: listener, Envoy admin, sidecar, sidecar admin API
        self.gateways = {name: dict(listen=free(), admin=free(), sidecar=free(), sidecar_admin=free()) for name in ("a", "b")}


def _pod_spec(workload):
    return workload["spec"]["template"]["spec"]


def _set_env(container, name, value):
    for e in container.setdefault("env", []):
        if e["name"] == name:
            e.pop("valueFrom", None)
            e["value"] = value
            return
    container["env"].append({"name": name, "value": value})


def _as_deployment(sts):
    """A StatefulSet as a Deployment podman plays: its claim templates as named volumes."""
    d = copy.deepcopy(sts)
    d["kind"] = "Deployment"
    spec = d["spec"]
    spec.pop("serviceName", None)
    claims = spec.pop("volumeClaimTemplates", [])
    vols = _pod_spec(d).setdefault("volumes", [])
    for c in claims:
        claim = c["metadata"]["name"]
        vols.append({"name": claim, "persistentVolumeClaim": {"claimName": f"{sts['metadata']['name']}-{claim}"}})
    return d


def _empty_dirs_as_named(spec, owner, volumes):
    for v in spec.get("volumes", []):
        if "emptyDir" in v:
            del v["emptyDir"]
            name = f"{owner}-{v['name']}"
            v["persistentVolumeClaim"] = {"claimName": name}
            volumes.append(name)


def _secret_as_host_path(spec, secrets, secret_dir):
    """Secret volumes as hostPath directories holding the Secret's files."""
    for v in spec.get("volumes", []):
        if "secret" in v:
            name = v["secret"]["secretName"]
            path = os.path.join(secret_dir, name)
            os.makedirs(path, mode=0o755, exist_ok=True)
            for key, value in secrets[name].get("stringData", {}).items():
                with open(os.path.join(path, key), "w") as f:
                    f.write(value)
                # the pods' users differ from the test's (root): readable, never writable
                os.chmod(os.path.join(path, key), 0o444)
            del v["secret"]
            v["hostPath"] = {"path": path, "type": "Directory"}


def _image(container, images, tag):
    ref = images.get(container["image"])
    if ref:
        container["image"] = f"{ref['newName']}:{tag}"


def render(ports, tag, secret_dir, extra_sidecar_toml="", sidecar_env=(), envoy_env=()):
    """Returns ({unit: [objects]}, [named volumes]): the files to play (stores, billing,
    gateway-a, gateway-b) and the podman volumes they make (ConfigMaps, claims, emptyDirs)."""
    volumes = ["tollgate-envoy", "tollgate-sidecar"]
    objects, images = load_base()
    objs = by_kind_name(objects)
    secrets = {n: o for (k, n), o in objs.items() if k == "Secret"}

    endpoints = copy.deepcopy(objs[("ConfigMap", "tollgate-endpoints")])
    endpoints["data"] = {
        "redis-url": f"redis://127.0.0.1:{ports.redis}/",
        "kafka-brokers": f"127.0.0.1:{ports.broker}",
        "postgres-url": f"postgres://postgres@127.0.0.1:{ports.postgres}/postgres",
    }
    envoy_cm = copy.deepcopy(objs[("ConfigMap", "tollgate-envoy")])
    text = envoy_cm["data"]["envoy.yaml"]
    want = "{address: tollgate-upstream, port_value: 8080}"
    assert want in text, "envoy-config.yaml: the upstream address changed; update deploy/test/render.py"
    text = text.replace(want, f"{{address: 127.0.0.1, port_value: {ports.upstream}}}")
    want = '"timeout":"25ms"'
    assert want in text, "envoy-config.yaml: the plugin's sidecar.timeout changed; update deploy/test/render.py"
    envoy_cm["data"]["envoy.yaml"] = text.replace(want, '"timeout":"2s"')
    sidecar_cm = copy.deepcopy(objs[("ConfigMap", "tollgate-sidecar")])
    sidecar_cm["data"]["sidecar.toml"] += extra_sidecar_toml

    def workload(kind, name, as_name=None):
        w = objs[(kind, name)]
        w = _as_deployment(w) if kind == "StatefulSet" else copy.deepcopy(w)
        w["metadata"]["name"] = as_name or name
        spec = _pod_spec(w)
        for v in spec.get("volumes", []):
            if "persistentVolumeClaim" in v:
                volumes.append(v["persistentVolumeClaim"]["claimName"])
        _empty_dirs_as_named(spec, w["metadata"]["name"], volumes)
        _secret_as_host_path(spec, secrets, secret_dir)
        for c in spec["containers"]:
            _image(c, images, tag)
            c.pop("ports", None)
        return w

    def replace_args(container, old, new):
        container["command"] = [a.replace(old, new) for a in container["command"]]

    redis = workload("StatefulSet", "tollgate-redis")
    c = _pod_spec(redis)["containers"][0]
    replace_args(c, "6379", str(ports.redis))
    c["readinessProbe"]["exec"]["command"] = [a.replace("6379", str(ports.redis)) for a in c["readinessProbe"]["exec"]["command"]]
    broker = workload("StatefulSet", "tollgate-broker")
    c = _pod_spec(broker)["containers"][0]
    replace_args(c, "0.0.0.0:9092", f"127.0.0.1:{ports.broker}")
    replace_args(c, "tollgate-broker:9092", f"127.0.0.1:{ports.broker}")
    postgres = workload("StatefulSet", "tollgate-postgres")
    c = _pod_spec(postgres)["containers"][0]
    _set_env(c, "PGPORT", str(ports.postgres))
    c["readinessProbe"]["exec"]["command"] = [a.replace("5432", str(ports.postgres)) for a in c["readinessProbe"]["exec"]["command"]]
    upstream = workload("Deployment", "tollgate-upstream")
    c = _pod_spec(upstream)["containers"][0]
    replace_args(c, "8080", str(ports.upstream))
    replace_args(c, "0.0.0.0", "127.0.0.1")

    billing = workload("Deployment", "tollgate-billing")
    c = _pod_spec(billing)["containers"][0]
    _set_env(c, "TOLLGATE_BILLING_METRICS_LISTEN", f"127.0.0.1:{ports.billing_metrics}")
    _set_env(c, "TOLLGATE_BILLING_KAFKA__BROKERS", endpoints["data"]["kafka-brokers"])
    _set_env(c, "TOLLGATE_BILLING_POSTGRES__URL", endpoints["data"]["postgres-url"])

    units = {"stores": [redis, broker, postgres, upstream], "billing": [billing]}
    for name, p in ports.gateways.items():
        g = workload("Deployment", "tollgate-gateway", f"tollgate-gateway-{name}")
        g["spec"]["replicas"] = 1
        envoy, sidecar = _pod_spec(g)["containers"]
        _set_env(envoy, "TOLLGATE_LISTEN_PORT", str(p["listen"]))
        _set_env(envoy, "TOLLGATE_ADMIN_PORT", str(p["admin"]))
        _set_env(envoy, "TOLLGATE_SIDECAR_PORT", str(p["sidecar"]))
        _set_env(sidecar, "TOLLGATE_SIDECAR_LISTEN", f"127.0.0.1:{p['sidecar']}")
        _set_env(sidecar, "TOLLGATE_SIDECAR_ADMIN__LISTEN", f"127.0.0.1:{p['sidecar_admin']}")
        _set_env(sidecar, "TOLLGATE_SIDECAR_REDIS__URL", endpoints["data"]["redis-url"])
        _set_env(sidecar, "TOLLGATE_SIDECAR_USAGE__KAFKA__BROKERS", endpoints["data"]["kafka-brokers"])
        _set_env(sidecar, "TOLLGATE_SIDECAR_REDIS__TIMEOUT", "1s")
        _set_env(sidecar, "TOLLGATE_SIDECAR_REDIS__DECISION_TIMEOUT", "1500ms")
        # overrides (checking that the tier fails without a lifecycle step: docs/deploy.md)
        for k, v in sidecar_env:
            _set_env(sidecar, k, v)
        for k, v in envoy_env:
            _set_env(envoy, k, v)
        units[f"gateway-{name}"] = [envoy_cm, sidecar_cm, g]
    return units, volumes


def write(units, directory):
    """Writes each unit as one multi-document file; returns {unit: path}."""
    paths = {}
    for unit, docs in units.items():
        path = os.path.join(directory, f"{unit}.yaml")
        with open(path, "w") as f:
            yaml.safe_dump_all(docs, f, sort_keys=False)
        paths[unit] = path
    return paths
