"""Static checks of the deployment files: deploy/kubernetes/*.yaml, deploy/compose.yaml, the
Dockerfile and .dockerignore. No cluster and no Docker daemon are needed.

Every Kubernetes object is walked field by field against the official ``kubernetes`` client
models (unknown fields and wrong types are errors: the client's own deserializer silently
drops unknown fields, so ``hostPid: true`` would pass it), then built through that
deserializer too, which refuses missing required fields. The rest checks what the product
needs: the agent sees the host's (or the pod's) processes, reads cgroups read-only, knows its
node, uses only flags ``oomcast collect`` has, and runs from the image the Dockerfile builds.
"""

from __future__ import annotations

import copy
import datetime as dt
import json
import re
import shutil
import subprocess
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import kubernetes.client as k8s
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"
TRIAL = ROOT / "deploy" / "kubernetes-trial"  # the installation plus a trial Redis
COMPOSE = ROOT / "deploy" / "compose.yaml"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]
NAMESPACE = "oomcast"
EXAMPLE = "training-pod-sidecar.yaml"  # an example for the user's own namespace

# ---------------------------------------------------------------------------------------------
# Strict validation against the client models
# ---------------------------------------------------------------------------------------------

KINDS: dict[tuple[str, str], type] = {
    ("v1", "Namespace"): k8s.V1Namespace,
    ("v1", "ServiceAccount"): k8s.V1ServiceAccount,
    ("v1", "Secret"): k8s.V1Secret,
    ("v1", "ConfigMap"): k8s.V1ConfigMap,
    ("v1", "Service"): k8s.V1Service,
    ("v1", "Pod"): k8s.V1Pod,
    ("apps/v1", "DaemonSet"): k8s.V1DaemonSet,
    ("apps/v1", "Deployment"): k8s.V1Deployment,
    ("apps/v1", "StatefulSet"): k8s.V1StatefulSet,
    ("batch/v1", "Job"): k8s.V1Job,
}

# Older clients spell container types list[X] and dict(str, X); newer ones List[X], Dict[str, X].
_OPTIONAL = re.compile(r"^Optional\[(.+)\]$")
_LIST = re.compile(r"^[Ll]ist\[(.+)\]$")
_DICT = re.compile(r"^(?:Dict\[str, (.+)\]|dict\(str, (.+)\))$")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_PRIMITIVES: dict[str, Callable[[Any], bool]] = {
    "str": lambda v: isinstance(v, str),
    "int": _is_int,
    "float": lambda v: _is_int(v) or isinstance(v, float),
    "bool": lambda v: isinstance(v, bool),
    # IntOrString (ports, maxUnavailable) and, in older clients, Quantity
    "object": lambda v: isinstance(v, str) or _is_int(v) or isinstance(v, float),
    "datetime": lambda v: isinstance(v, str | dt.datetime),
    "date": lambda v: isinstance(v, str | dt.date),
    "bytes": lambda v: isinstance(v, str),
}


def strict_errors(value: Any, type_name: str, path: str = "") -> list[str]:
    """Every unknown field, null and type mismatch in ``value`` read as ``type_name``."""
    where = path or "<root>"
    if value is None:
        return [f"{where}: null (leave the field out instead)"]
    if m := _OPTIONAL.match(type_name):
        return strict_errors(value, m.group(1), path)
    if m := _LIST.match(type_name):
        return _list_errors(value, m.group(1), path)
    if m := _DICT.match(type_name):
        return _dict_errors(value, m.group(1) or m.group(2), path)
    if type_name in _PRIMITIVES:
        if _PRIMITIVES[type_name](value):
            return []
        return [f"{where}: expected {type_name}, got {type(value).__name__} {value!r}"]
    return _model_errors(value, type_name, path)


def _list_errors(value: Any, inner: str, path: str) -> list[str]:
    """strict_errors of a list[inner]."""
    if not isinstance(value, list):
        return [f"{path or '<root>'}: expected a list of {inner}, got {type(value).__name__}"]
    errors: list[str] = []
    for i, item in enumerate(value):
        errors += strict_errors(item, inner, f"{path}[{i}]")
    return errors


def _dict_errors(value: Any, inner: str, path: str) -> list[str]:
    """strict_errors of a mapping of str to inner."""
    where = path or "<root>"
    if not isinstance(value, dict):
        return [f"{where}: expected a mapping of {inner}, got {type(value).__name__}"]
    errors: list[str] = []
    for key, item in value.items():
        if not isinstance(key, str):
            errors.append(f"{where}: key {key!r} is not a string")
        errors += strict_errors(item, inner, f"{path}.{key}")
    return errors


def _model_errors(value: Any, type_name: str, path: str) -> list[str]:
    """strict_errors of an object read as the client model ``type_name``, field by field."""
    where = path or "<root>"
    model = getattr(k8s, type_name, None)
    if model is None or not hasattr(model, "openapi_types"):
        return [f"{where}: no client model {type_name}"]
    if not isinstance(value, dict):
        return [f"{where}: expected a {type_name} mapping, got {type(value).__name__}"]
    by_json = {json_name: attr for attr, json_name in model.attribute_map.items()}
    errors: list[str] = []
    for key, item in value.items():
        attr = by_json.get(key)
        if attr is None:
            errors.append(f"{path}.{key}: unknown field of {type_name}".lstrip("."))
            continue
        errors += strict_errors(item, model.openapi_types[attr], f"{path}.{key}".lstrip("."))
    return errors


def model_for(doc: dict[str, Any]) -> type:
    key = (doc.get("apiVersion"), doc.get("kind"))
    if key not in KINDS:
        raise AssertionError(f"no client model mapped for apiVersion/kind {key}")
    return KINDS[key]  # type: ignore[index]


def construct(doc: dict[str, Any], model: type) -> Any:
    """Build the object through the client's deserializer: missing required fields raise
    ValueError (client-side validation; a pydantic ValidationError in newer clients)."""
    deserialize = k8s.ApiClient()._ApiClient__deserialize  # type: ignore[attr-defined]
    return deserialize(doc, model.__name__)


# ---------------------------------------------------------------------------------------------
# Loading and navigating the manifests
# ---------------------------------------------------------------------------------------------


def manifest_files() -> list[Path]:
    """The base's manifests and the trial overlay's (deploy/kubernetes-trial)."""
    found = [*KUBE.glob("*.yaml"), *TRIAL.glob("*.yaml")]
    return sorted(p for p in found if p.name != "kustomization.yaml")


def load_objects() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for path in manifest_files():
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                found.append((path.name, doc))
    return found


OBJECTS = load_objects()


def obj_id(item: tuple[str, dict[str, Any]]) -> str:
    name, doc = item
    return f"{name}:{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"


def find(kind: str, name: str) -> dict[str, Any]:
    hits = [d for _, d in OBJECTS if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(hits) == 1, f"expected one {kind}/{name}, found {len(hits)}"
    return hits[0]


def pod_spec(doc: dict[str, Any]) -> dict[str, Any] | None:
    if doc["kind"] == "Pod":
        return doc["spec"]
    if doc["kind"] in ("DaemonSet", "Deployment", "StatefulSet", "Job"):
        return doc["spec"]["template"]["spec"]
    return None


def containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return list(spec.get("initContainers", [])) + list(spec["containers"])


def workloads() -> Iterator[tuple[str, dict[str, Any], dict[str, Any], dict[str, Any]]]:
    """(file, object, pod spec, container) for every container of every workload."""
    for fname, doc in OBJECTS:
        spec = pod_spec(doc)
        if spec is not None:
            for c in containers(spec):
                yield fname, doc, spec, c


def env_map(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def effective(container: dict[str, Any], spec: dict[str, Any], key: str) -> Any:
    """A security setting of the container, else of the pod."""
    own = container.get("securityContext", {})
    return own[key] if key in own else spec.get("securityContext", {}).get(key)


def field_ref(env: dict[str, Any]) -> str | None:
    return env.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")


# ---------------------------------------------------------------------------------------------
# The Dockerfile
# ---------------------------------------------------------------------------------------------


def dockerfile_stages() -> dict[str, dict[str, Any]]:
    """Stage name -> {"base": image or stage, "steps": [(INSTRUCTION, text)]}."""
    lines, buf = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        if not buf and (not raw.strip() or raw.lstrip().startswith("#")):
            continue
        if raw.rstrip().endswith("\\"):
            buf += raw.rstrip()[:-1] + " "
            continue
        lines.append(buf + raw)
        buf = ""
    stages: dict[str, dict[str, Any]] = {}
    current: dict[str, Any] | None = None
    for line in lines:
        instr, _, rest = line.strip().partition(" ")
        instr = instr.upper()
        if instr == "FROM":
            m = re.match(r"(?:--\S+\s+)*(\S+)(?:\s+AS\s+(\S+))?\s*$", rest.strip(), re.I)
            assert m, f"cannot read FROM {rest}"
            current = {"base": m.group(1), "steps": []}
            stages[m.group(2) or f"#{len(stages)}"] = current
        elif current is not None:
            current["steps"].append((instr, rest.strip()))
    return stages


STAGES = dockerfile_stages()


def stage_closure(name: str) -> list[str]:
    """The stage and every stage it builds on or copies from."""
    seen: list[str] = []
    todo = [name]
    while todo:
        stage = todo.pop()
        if stage in seen or stage not in STAGES:
            continue
        seen.append(stage)
        todo.append(STAGES[stage]["base"])
        for instr, text in STAGES[stage]["steps"]:
            if instr in ("COPY", "RUN"):
                todo += re.findall(r"--(?:from=|mount=\S*from=)([\w.-]+)", text)
    return seen


def stage_json(stage: str, instr: str) -> list[str]:
    values = [json.loads(t) for i, t in STAGES[stage]["steps"] if i == instr]
    assert values, f"stage {stage} has no {instr}"
    return values[-1]


def pip_installs(stage: str) -> list[str]:
    return [
        text
        for s in stage_closure(stage)
        for instr, text in STAGES[s]["steps"]
        if instr == "RUN" and re.search(r"\bpip\b.*\binstall\b", text)
    ]


def installed_extras(stage: str) -> set[str]:
    extras: set[str] = set()
    for text in pip_installs(stage):
        for group in re.findall(r"\[([A-Za-z0-9_, -]+)\]", text):
            extras |= {e.strip() for e in group.split(",")}
    return extras


def requirement_names(extras: set[str]) -> set[str]:
    """Distribution names installed by the core plus ``extras``, following oomcast[...]."""
    optional = PYPROJECT["project"]["optional-dependencies"]
    reqs = list(PYPROJECT["project"]["dependencies"])
    seen: set[str] = set()
    todo = list(extras)
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        assert extra in optional, f"the Dockerfile installs an unknown extra [{extra}]"
        seen.add(extra)
        for req in optional[extra]:
            if m := re.match(r"oomcast\[(.+)\]", req):
                todo += [e.strip() for e in m.group(1).split(",")]
            else:
                reqs.append(req)
    return {re.match(r"[A-Za-z0-9_.-]+", r).group(0).lower().replace("_", "-") for r in reqs}  # type: ignore[union-attr]


# ---------------------------------------------------------------------------------------------
# The oomcast command lines
# ---------------------------------------------------------------------------------------------


def _positive_float(v: str) -> None:
    if float(v) <= 0:
        raise ValueError("must be > 0")


def _abs_path(v: str) -> None:
    if not v.startswith("/"):
        raise ValueError("must be an absolute path")


def _port(v: str) -> None:
    if not 0 <= int(v) <= 65535:
        raise ValueError("not a port")


def _host(v: str) -> None:
    if not v or " " in v:
        raise ValueError("not a host")


def _sources(v: str) -> None:
    names = v.split(",")
    if not names or any(n not in ("nvml", "cgroup", "sim", "replay") for n in names):
        raise ValueError("comma-separated nvml, cgroup, sim, replay")
    if len(set(names)) != len(names):
        raise ValueError("a source named twice")


def _redis_url(v: str) -> None:
    if urlparse(v).scheme not in ("redis", "rediss", "unix"):
        raise ValueError("not a redis URL")


def _nonempty(v: str) -> None:
    if not v:
        raise ValueError("empty")


# The node agent's interface (the manifests are written against exactly this).
COLLECT_FLAGS: dict[str, Callable[[str], None]] = {
    "--source": _sources,
    "--node": _nonempty,
    "--nvml-interval": _positive_float,
    "--cgroup-interval": _positive_float,
    "--cgroup-root": _abs_path,
    "--proc-root": _abs_path,
    "--metrics-host": _host,
    "--metrics-port": _port,
    "--redis-url": _redis_url,
}


def _workers(v: str) -> None:
    from oomcast.service.cluster.workers import parse_workers

    parse_workers(v, cap=4)  # WorkersError (a ValueError) for anything but a count or auto


SERVE_FLAGS: dict[str, Callable[[str], None]] = {
    "--host": _host,
    "--port": _port,
    "--workers": _workers,
}
SUBCOMMANDS = {"collect": COLLECT_FLAGS, "serve": SERVE_FLAGS}
REQUIRED = {"collect": {"--source"}, "serve": set()}
TARGET_OF = {"collect": "collector", "serve": "service"}


def _log_level(v: str) -> None:
    if v not in ("debug", "info", "warning", "error"):
        raise ValueError("not a log level")


def parse_oomcast(argv: list[str]) -> tuple[str, dict[str, str]]:
    """(subcommand, {flag: value}) of an ``oomcast`` command line; ValueError on any flag the
    interface does not have, a missing value, a repeated flag or a bad value."""
    if not argv or argv[0] != "oomcast":
        raise ValueError(f"not an oomcast command line: {argv}")
    rest = list(argv[1:])
    while rest and rest[0].startswith("--log-level"):
        flag, _, value = rest.pop(0).partition("=")
        _log_level(value or rest.pop(0))
    if not rest or rest[0] not in SUBCOMMANDS:
        raise ValueError(f"unknown or missing subcommand in {argv}")
    sub = rest.pop(0)
    table = SUBCOMMANDS[sub]
    opts: dict[str, str] = {}
    while rest:
        token = rest.pop(0)
        flag, eq, value = token.partition("=")
        if not flag.startswith("--") or flag not in table:
            raise ValueError(f"oomcast {sub}: unknown flag or argument {token!r}")
        if not eq:
            if not rest or rest[0].startswith("--"):
                raise ValueError(f"oomcast {sub}: {flag} needs a value")
            value = rest.pop(0)
        if flag in opts:
            raise ValueError(f"oomcast {sub}: {flag} given twice")
        try:
            table[flag](value)
        except ValueError as exc:
            raise ValueError(f"oomcast {sub}: {flag} {value!r}: {exc}") from None
        opts[flag] = value
    missing = REQUIRED[sub] - opts.keys()
    if missing:
        raise ValueError(f"oomcast {sub}: missing {', '.join(sorted(missing))}")
    return sub, opts


def image_target(image: str) -> str | None:
    """'oomcast-collector:0.1.0' -> 'collector'; None for other images."""
    m = re.match(r"^(?:.*/)?oomcast-([a-z]+)(?::(.+))?$", image)
    return m.group(1) if m else None


def k8s_argv(container: dict[str, Any]) -> list[str]:
    """What the container runs: command (else the image's ENTRYPOINT) + args (else CMD)."""
    target = image_target(container["image"])
    if "command" in container:
        command = container["command"]
    elif target in STAGES:
        command = stage_json(target, "ENTRYPOINT")
    else:
        command = [f"<entrypoint of {container['image']}>"]
    if "args" in container:
        return [*command, *container["args"]]
    return [*command, *(stage_json(target, "CMD") if target in STAGES else [])]


def oomcast_containers() -> Iterator[tuple[str, dict[str, Any], dict[str, Any], dict[str, Any]]]:
    for fname, doc, spec, c in workloads():
        if k8s_argv(c)[:1] == ["oomcast"]:
            yield fname, doc, spec, c


def agents() -> list[tuple[str, dict[str, Any], dict[str, Any], dict[str, Any]]]:
    return [w for w in oomcast_containers() if k8s_argv(w[3])[1:2] == ["collect"]]


# ---------------------------------------------------------------------------------------------
# The validator itself cannot pass vacuously
# ---------------------------------------------------------------------------------------------


def _daemonset() -> dict[str, Any]:
    return copy.deepcopy(find("DaemonSet", "oomcast-agent"))


def test_there_is_something_to_validate() -> None:
    kinds = {d["kind"] for _, d in OBJECTS}
    assert {"Namespace", "ServiceAccount", "DaemonSet", "Deployment", "Service", "Job"} <= kinds
    assert {p.name for p in manifest_files()} == {
        "agent-daemonset.yaml",
        "service.yaml",
        "training-pod-sidecar.yaml",
        "redis.yaml",
    }


def test_validator_catches_a_misspelled_field() -> None:
    doc = _daemonset()
    doc["spec"]["template"]["spec"]["hostPid"] = True
    errors = strict_errors(doc, "V1DaemonSet")
    assert errors == ["spec.template.spec.hostPid: unknown field of V1PodSpec"]
    mount = doc["spec"]["template"]["spec"]["containers"][0]["volumeMounts"][0]
    mount["readonly"] = mount.pop("readOnly")
    errors = strict_errors(doc, "V1DaemonSet")
    assert "spec.template.spec.containers[0].volumeMounts[0].readonly: unknown field of" in (
        "\n".join(errors)
    )


def test_validator_catches_wrong_types() -> None:
    doc = _daemonset()
    agent = doc["spec"]["template"]["spec"]["containers"][0]
    agent["ports"][0]["containerPort"] = "9101"
    agent["volumeMounts"][0]["readOnly"] = "true"
    agent["args"] = "collect --source nvml"
    doc["metadata"]["labels"]["replicas"] = 3
    errors = "\n".join(strict_errors(doc, "V1DaemonSet"))
    assert "spec.template.spec.containers[0].ports[0].containerPort: expected int" in errors
    assert "spec.template.spec.containers[0].volumeMounts[0].readOnly: expected bool" in errors
    assert "spec.template.spec.containers[0].args: expected a list of" in errors
    assert "metadata.labels.replicas: expected str" in errors


def test_validator_catches_nulls_and_nesting_errors() -> None:
    doc = _daemonset()
    doc["spec"]["template"]["spec"]["tolerations"] = None
    doc["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]["required"] = {}
    errors = strict_errors(doc, "V1DaemonSet")
    assert "spec.template.spec.tolerations: null (leave the field out instead)" in errors
    assert "spec.template.spec.affinity.nodeAffinity.required: unknown field of V1NodeAffinity" in (
        errors
    )


def test_construct_refuses_a_missing_required_field() -> None:
    doc = _daemonset()
    del doc["spec"]["template"]["spec"]["containers"][0]["name"]
    assert strict_errors(doc, "V1DaemonSet") == []  # only the model can tell
    with pytest.raises(ValueError):
        construct(doc, k8s.V1DaemonSet)
    doc = _daemonset()
    del doc["spec"]["selector"]
    with pytest.raises(ValueError):
        construct(doc, k8s.V1DaemonSet)


def test_command_line_parser_catches_typos() -> None:
    good = ["oomcast", "collect", "--source", "nvml,cgroup", "--metrics-port=9101"]
    assert parse_oomcast(good) == ("collect", {"--source": "nvml,cgroup", "--metrics-port": "9101"})
    for bad in (
        ["oomcast", "collect", "--source", "nvml", "--cgroup_root", "/x"],
        ["oomcast", "collect", "--source", "nvml", "--metrics-prot", "9101"],
        ["oomcast", "collect", "--source", "nvml,cgroups"],
        ["oomcast", "collect", "--source", "nvml", "--nvml-interval", "fast"],
        ["oomcast", "collect", "--source", "nvml", "--cgroup-root", "host/sys/fs/cgroup"],
        ["oomcast", "collect", "--source", "nvml", "--source", "cgroup"],
        ["oomcast", "collect", "--source", "nvml", "--proc-root"],
        ["oomcast", "collect", "--node", "n1"],
        ["oomcast", "collect", "--source", "nvml", "stray"],
        ["oomcast", "collct", "--source", "nvml"],
        ["oomcast", "serve", "--port", "eighty"],
    ):
        with pytest.raises(ValueError):
            parse_oomcast(bad)


# ---------------------------------------------------------------------------------------------
# Every object is valid
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("item", OBJECTS, ids=obj_id)
def test_object_is_strictly_valid(item: tuple[str, dict[str, Any]]) -> None:
    _, doc = item
    model = model_for(doc)
    assert strict_errors(doc, model.__name__) == []
    built = construct(doc, model)
    assert type(built) is model
    assert built.kind == doc["kind"]


@pytest.mark.parametrize("item", OBJECTS, ids=obj_id)
def test_object_is_labelled_and_namespaced(item: tuple[str, dict[str, Any]]) -> None:
    fname, doc = item
    meta = doc["metadata"]
    if fname == EXAMPLE:
        assert "namespace" not in meta, "the example goes into the user's own namespace"
    elif doc["kind"] != "Namespace":
        assert meta.get("namespace") == NAMESPACE
        assert meta["labels"]["app.kubernetes.io/part-of"] == "oomcast"


def test_selectors_match_their_pods() -> None:
    for _, doc in OBJECTS:
        if doc["kind"] in ("DaemonSet", "Deployment", "StatefulSet"):
            wanted = doc["spec"]["selector"]["matchLabels"]
            labels = doc["spec"]["template"]["metadata"]["labels"]
            assert wanted.items() <= labels.items(), doc["metadata"]["name"]
    for _, svc in OBJECTS:
        if svc["kind"] != "Service":
            continue
        selector = svc["spec"]["selector"].items()
        pods = [
            (d, c)
            for _, d, _, c in workloads()
            if d["metadata"].get("namespace") == svc["metadata"]["namespace"]
            and selector <= d["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert pods, f"Service {svc['metadata']['name']} selects no pod"
        names = {p["name"] for _, c in pods for p in c.get("ports", [])}
        numbers = {p["containerPort"] for _, c in pods for p in c.get("ports", [])}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in names | numbers, port


def test_probes_use_declared_ports_and_every_container_is_bounded() -> None:
    for _, _, _, c in workloads():
        ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
        for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
            action = c.get(probe, {}).get("httpGet") or c.get(probe, {}).get("tcpSocket")
            if action:
                port = action["port"]
                assert port in ports or port in ports.values(), (c["name"], probe, port)
        assert "memory" in c["resources"]["limits"], c["name"]
        assert "requests" in c["resources"], c["name"]


def test_required_secret_references_exist() -> None:
    secrets = {
        (d["metadata"]["name"], key)
        for _, d in OBJECTS
        if d["kind"] == "Secret"
        for key in {**d.get("data", {}), **d.get("stringData", {})}
    }
    for _, _, _, c in workloads():
        for env in c.get("env", []):
            ref = env.get("valueFrom", {}).get("secretKeyRef")
            if ref and not ref.get("optional", False):
                assert (ref["name"], ref["key"]) in secrets, (c["name"], env["name"])


def test_images_are_the_dockerfile_targets_at_the_project_version() -> None:
    seen = set()
    for _, _, _, c in workloads():
        image = c["image"]
        assert re.search(r":[\w][\w.-]*$", image) and not image.endswith(":latest"), image
        argv = k8s_argv(c)
        target = image_target(image)
        if argv[:1] == ["oomcast"]:
            sub, _ = parse_oomcast(argv)
            assert target == TARGET_OF[sub], f"{c['name']} runs oomcast {sub} from {image}"
            assert target in STAGES
            assert image == f"oomcast-{target}:{VERSION}"
            seen.add(target)
        else:
            assert target is None, f"{c['name']}: {image} without an oomcast command"
    assert seen == {"service", "collector"}


def test_oomcast_env_is_known() -> None:
    from oomcast.service.settings import Settings

    service_env = {f"OOMCAST_{name.upper()}" for name in Settings.model_fields}
    service_env |= {"OOMCAST_CONTROL_SECRET", "OOMCAST_LOG_LEVEL"}
    pod_env = {"OOMCAST_NODE", "OOMCAST_POD_NAME", "OOMCAST_POD_NAMESPACE", "OOMCAST_POD_UID"}
    agent_env = pod_env | {
        "OOMCAST_REDIS_URL",
        "OOMCAST_CGROUP_ROOT",
        "OOMCAST_PROC_ROOT",
        "OOMCAST_AGENT_METRICS_PORT",
        "OOMCAST_KEY_PREFIX",
        "OOMCAST_PARTITIONS",
        "OOMCAST_STREAM_MAXLEN",
        "OOMCAST_LOG_LEVEL",
        "OOMCAST_NODE_KEY",  # the node's own key: verifies commands, signs samples
        "OOMCAST_NODE_KEY_FILE",  # or a file holding it (the DaemonSet's, from the host)
    }
    hook_env = pod_env | {"OOMCAST_REDIS_URL", "OOMCAST_JOB", "OOMCAST_PRIORITY"}
    for _, _, _, c in workloads():
        names = {n for n in env_map(c) if n.startswith("OOMCAST_")}
        argv = k8s_argv(c)
        if argv[:2] == ["oomcast", "serve"]:
            known = service_env
        elif argv[:2] == ["oomcast", "collect"]:
            known = agent_env
        else:
            known = hook_env
        assert names <= known, f"{c['name']}: unknown {sorted(names - known)}"


# ---------------------------------------------------------------------------------------------
# The node agent
# ---------------------------------------------------------------------------------------------


def test_every_agent_command_line_uses_only_the_collect_interface() -> None:
    found = agents()
    assert len(found) == 2  # the DaemonSet and the sidecar
    for _, _, spec, c in found:
        _, opts = parse_oomcast(k8s_argv(c))
        assert set(opts["--source"].split(",")) == {"nvml", "cgroup"}
        # the kubelet's probes and Prometheus come from outside the pod
        assert opts["--metrics-host"] == "0.0.0.0"
        metrics = {p["name"]: p["containerPort"] for p in c["ports"]}["metrics"]
        assert int(opts["--metrics-port"]) == metrics
        for probe in ("livenessProbe", "readinessProbe"):
            if probe in c:
                assert c[probe]["httpGet"]["port"] in ("metrics", metrics)
                assert c[probe]["httpGet"]["path"] in ("/livez", "/readyz")
        # the pids NVML reports must be in this /proc
        assert opts["--proc-root"] == "/proc"
        assert spec.get("hostPID") is True or spec.get("shareProcessNamespace") is True
        # the cgroup root is the host's tree, mounted read-only
        volumes = {v["name"]: v for v in spec["volumes"]}
        mounts = [
            m
            for m in c["volumeMounts"]
            if (opts["--cgroup-root"] + "/").startswith(m["mountPath"].rstrip("/") + "/")
        ]
        assert len(mounts) == 1, opts["--cgroup-root"]
        assert mounts[0]["readOnly"] is True
        assert volumes[mounts[0]["name"]]["hostPath"]["path"] == "/sys/fs/cgroup"


def test_every_agent_knows_its_node_and_reaches_redis_through_a_secret() -> None:
    for _, _, _, c in agents():
        env = env_map(c)
        assert field_ref(env["OOMCAST_NODE"]) == "spec.nodeName"
        assert field_ref(env["OOMCAST_POD_NAME"]) == "metadata.name"
        assert env["OOMCAST_REDIS_URL"]["valueFrom"]["secretKeyRef"]["key"] == "url"
        assert "value" not in env["OOMCAST_REDIS_URL"]


def test_every_agent_sees_gpus_without_reserving_one() -> None:
    for _, _, spec, c in agents():
        env = env_map(c)
        assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
        assert env["NVIDIA_DRIVER_CAPABILITIES"]["value"] == "utility"
        assert spec["runtimeClassName"] == "nvidia"
        for kind in ("requests", "limits"):
            assert not any("gpu" in r for r in c["resources"].get(kind, {})), c["resources"]


def test_daemonset_agent() -> None:
    ds = find("DaemonSet", "oomcast-agent")
    spec = ds["spec"]["template"]["spec"]
    assert spec["hostPID"] is True
    assert not spec.get("hostNetwork", False)
    find("ServiceAccount", spec["serviceAccountName"])
    find("Namespace", NAMESPACE)
    assert any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])
    assert spec.get("nodeSelector") or spec["affinity"]["nodeAffinity"]
    (agent,) = spec["containers"]
    sc = agent["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert not sc.get("privileged", False)
    # root, for three capabilities only (see the Dockerfile's collector stage)
    assert sc["runAsUser"] == 0
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert set(sc["capabilities"]["add"]) == {"DAC_READ_SEARCH", "SYS_PTRACE", "KILL"}
    assert "readinessProbe" in agent and "livenessProbe" in agent


def test_sidecar_agent_shares_the_trainers_processes() -> None:
    job = find("Job", "resnet-finetune")
    spec = job["spec"]["template"]["spec"]
    assert spec["shareProcessNamespace"] is True
    assert not spec.get("hostPID", False)
    assert spec["restartPolicy"] in ("Never", "OnFailure")
    sidecars = [c for c in spec["initContainers"] if c.get("restartPolicy") == "Always"]
    assert [k8s_argv(c)[:2] for c in sidecars] == [["oomcast", "collect"]]
    (agent,) = sidecars
    (trainer,) = spec["containers"]
    for c in (agent, trainer):
        env = env_map(c)
        assert field_ref(env["OOMCAST_NODE"]) == "spec.nodeName"
        assert field_ref(env["OOMCAST_POD_NAME"]) == "metadata.name"
        assert field_ref(env["OOMCAST_POD_UID"]) == "metadata.uid"
    env = env_map(trainer)
    assert env["OOMCAST_JOB"]["value"] == job["metadata"]["name"]
    int(env["OOMCAST_PRIORITY"]["value"])
    assert "nvidia.com/gpu" in trainer["resources"]["limits"]
    # same uid, so the agent reads and signals the trainer without any capability
    uid = effective(agent, spec, "runAsUser")
    assert uid == effective(trainer, spec, "runAsUser") and uid not in (None, 0)
    assert effective(agent, spec, "runAsNonRoot") is True
    assert agent["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert agent["securityContext"]["readOnlyRootFilesystem"] is True
    assert agent["securityContext"]["allowPrivilegeEscalation"] is False


# ---------------------------------------------------------------------------------------------
# The service
# ---------------------------------------------------------------------------------------------


def dockerfile_service_uid() -> int:
    users = [t for i, t in STAGES["service"]["steps"] if i == "USER"]
    assert users, "the service stage has no USER"
    return int(users[-1].split(":")[0])


def test_service_deployment() -> None:
    dep = find("Deployment", "oomcast-service")
    spec = dep["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    sub, opts = parse_oomcast(k8s_argv(c))
    assert sub == "serve" and opts["--host"] == "0.0.0.0"
    assert opts.get("--workers") == "auto"  # a worker per core of the pod's CPU limit
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert int(opts["--port"]) == ports["http"]
    assert c["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    # one consumer per partition set: never two pods at once
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"
    env = env_map(c)
    assert env["OOMCAST_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {
        "name": "oomcast-redis",
        "key": "url",
    }
    for name in ("OOMCAST_WEBHOOK_URL", "OOMCAST_WEBHOOK_SECRET", "OOMCAST_API_TOKEN"):
        ref = env[name]["valueFrom"]["secretKeyRef"]
        assert ref["name"] == "oomcast-service" and ref["optional"] is True
    assert effective(c, spec, "runAsNonRoot") is True
    assert effective(c, spec, "runAsUser") == dockerfile_service_uid()
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    find("Service", "oomcast-service")


def test_trial_redis_is_labelled_as_such() -> None:
    text = (TRIAL / "redis.yaml").read_text()
    assert text.startswith("# NOT FOR PRODUCTION")
    secret = find("Secret", "oomcast-redis")
    url = urlparse(secret["stringData"]["url"])
    assert url.scheme == "redis" and url.hostname.startswith("redis.oomcast.")  # type: ignore[union-attr]
    find("Service", "redis")


def test_kustomization_lists_the_installation() -> None:
    kz = yaml.safe_load((KUBE / "kustomization.yaml").read_text())
    assert kz["kind"] == "Kustomization"
    listed = kz["resources"]
    assert all((KUBE / r).is_file() for r in listed)
    assert set(listed) == {p.name for p in KUBE.glob("*.yaml")} - {EXAMPLE, "kustomization.yaml"}
    trial = yaml.safe_load((TRIAL / "kustomization.yaml").read_text())
    assert trial["resources"] == ["../kubernetes", "redis.yaml"]


def _secrets(objects: list[dict[str, Any]]) -> list[str]:
    return [d["metadata"]["name"] for d in objects if d["kind"] == "Secret"]


def test_the_installation_never_overwrites_the_users_redis_secret() -> None:
    """docs/deployment.md has the user create the oomcast-redis Secret, then apply the
    kustomization: it used to include the trial Redis, whose Secret replaced theirs."""
    base = [
        d
        for r in yaml.safe_load((KUBE / "kustomization.yaml").read_text())["resources"]
        for d in yaml.safe_load_all((KUBE / r).read_text())
        if d
    ]
    assert "oomcast-redis" not in _secrets(base)
    trial = [d for d in yaml.safe_load_all((TRIAL / "redis.yaml").read_text()) if d]
    assert "oomcast-redis" in _secrets(trial)
    docs = (ROOT / "docs" / "deployment.md").read_text()
    assert "create secret generic oomcast-redis" in docs
    assert "kubectl apply -k deploy/kubernetes\n" in docs
    assert "kubectl apply -k deploy/kubernetes-trial" in docs


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
@pytest.mark.parametrize(
    ("where", "has_redis"), [("kubernetes", False), ("kubernetes-trial", True)]
)
def test_kubectl_kustomize_builds(where: str, has_redis: bool) -> None:
    out = subprocess.run(
        ["kubectl", "kustomize", str(ROOT / "deploy" / where)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    objects = [d for d in yaml.safe_load_all(out.stdout) if d]
    kinds = [d["kind"] for d in objects]
    assert "DaemonSet" in kinds and "Deployment" in kinds
    assert ("oomcast-redis" in _secrets(objects)) is has_redis


# ---------------------------------------------------------------------------------------------
# The real CLI, once it has the flags the manifests use
# ---------------------------------------------------------------------------------------------


def all_command_lines() -> list[list[str]]:
    lines = [k8s_argv(c) for _, _, _, c in oomcast_containers()]
    compose = yaml.safe_load(COMPOSE.read_text())["services"]
    for svc in compose.values():
        if "build" in svc:
            lines.append([*stage_json(svc["build"]["target"], "ENTRYPOINT"), *svc["command"]])
    for target in ("service", "collector"):
        lines.append([*stage_json(target, "ENTRYPOINT"), *stage_json(target, "CMD")])
    return lines


def test_every_command_line_parses_with_the_interface() -> None:
    lines = all_command_lines()
    assert len(lines) == 7  # 3 in manifests, 2 in compose, 2 image defaults
    for argv in lines:
        parse_oomcast(argv)


def test_command_lines_parse_with_the_real_cli() -> None:
    from oomcast.cli.main import build_parser

    parser = build_parser()
    sub_action = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    collect = sub_action.choices["collect"]  # type: ignore[attr-defined]
    known = set(collect._option_string_actions)
    assert set(COLLECT_FLAGS) <= known, f"the CLI lacks {sorted(set(COLLECT_FLAGS) - known)}"
    for argv in all_command_lines():
        try:
            parser.parse_args(argv[1:])
        except SystemExit as exc:  # argparse's way of refusing
            raise AssertionError(f"the CLI refuses {argv}") from exc


# ---------------------------------------------------------------------------------------------
# Compose
# ---------------------------------------------------------------------------------------------

# The service keys of the Compose Specification that this file may use.
COMPOSE_SERVICE_KEYS = {
    "build", "image", "command", "entrypoint", "environment", "env_file", "ports", "expose",
    "volumes", "depends_on", "healthcheck", "restart", "pid", "user", "read_only", "tmpfs",
    "cap_add", "cap_drop", "security_opt", "deploy", "labels", "hostname", "networks",
    "init", "stop_grace_period", "logging", "ulimits", "shm_size", "runtime", "devices",
}  # fmt: skip


def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def test_compose_has_the_three_services() -> None:
    services = compose()["services"]
    assert set(services) == {"redis", "service", "agent"}
    for name, svc in services.items():
        assert set(svc) <= COMPOSE_SERVICE_KEYS, f"{name}: {set(svc) - COMPOSE_SERVICE_KEYS}"
    for name, target in (("service", "service"), ("agent", "collector")):
        svc = services[name]
        assert svc["build"]["target"] == target and target in STAGES
        build = svc["build"]
        assert (COMPOSE.parent / build["context"] / build["dockerfile"]).resolve() == DOCKERFILE
        assert svc["image"] == f"oomcast-{target}:{VERSION}"
        assert svc["environment"]["OOMCAST_REDIS_URL"] == "redis://redis:6379/0"
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy"
    assert "healthcheck" in services["redis"]


def test_compose_agent() -> None:
    agent = compose()["services"]["agent"]
    _, opts = parse_oomcast([*stage_json("collector", "ENTRYPOINT"), *agent["command"]])
    assert agent["pid"] == "host" and opts["--proc-root"] == "/proc"
    assert f"/sys/fs/cgroup:{opts['--cgroup-root']}:ro" in agent["volumes"]
    assert f"127.0.0.1:{opts['--metrics-port']}:{opts['--metrics-port']}" in agent["ports"]
    assert agent["read_only"] is True and agent["cap_drop"] == ["ALL"]
    assert set(agent["cap_add"]) == {"DAC_READ_SEARCH", "SYS_PTRACE", "KILL"}
    (gpu,) = agent["deploy"]["resources"]["reservations"]["devices"]
    assert gpu["driver"] == "nvidia" and gpu["capabilities"] == ["utility"]
    assert "OOMCAST_NODE" in agent["environment"]


def test_compose_service() -> None:
    svc = compose()["services"]["service"]
    _, opts = parse_oomcast([*stage_json("service", "ENTRYPOINT"), *svc["command"]])
    assert f"127.0.0.1:{opts['--port']}:{opts['--port']}" in svc["ports"]
    assert int(svc["user"].split(":")[0]) == dockerfile_service_uid()
    assert svc["read_only"] is True and svc["cap_drop"] == ["ALL"]
    # an empty OOMCAST_API_TOKEN would still be a token
    assert all(v not in ("", None) for v in svc["environment"].values())


# ---------------------------------------------------------------------------------------------
# The Dockerfile and .dockerignore
# ---------------------------------------------------------------------------------------------


def test_dockerfile_has_both_targets() -> None:
    text = DOCKERFILE.read_text()
    for target in ("service", "collector"):
        assert re.search(rf"^FROM\s+\S+\s+AS\s+{target}\s*$", text, re.M | re.I), target
        assert stage_json(target, "ENTRYPOINT") == ["oomcast"]
    assert stage_json("collector", "CMD") == ["collect", "--source", "nvml,cgroup"]
    assert stage_json("service", "CMD")[0] == "serve"


def test_final_images_get_the_wheel_not_the_build() -> None:
    for target in ("service", "collector"):
        final = STAGES[target]
        # a fresh base image, not a stage holding the source or build tools
        assert final["base"] not in STAGES
        assert not any(i in ("RUN", "COPY") and "pip" in t for i, t in final["steps"])
        copies = [t for i, t in final["steps"] if i == "COPY"]
        assert copies and all(t.startswith("--from=") for t in copies), copies
        closure = stage_closure(target)
        builds = [
            t for s in closure for i, t in STAGES[s]["steps"] if i == "RUN" and "pip wheel" in t
        ]
        assert builds, f"{target}: no stage builds the wheel"
        installs = pip_installs(target)
        assert installs and all(re.search(r"/wheels/oomcast-\*\.whl", t) for t in installs)


def test_service_image_runs_as_a_user() -> None:
    assert dockerfile_service_uid() not in (0,)
    users = [t for i, t in STAGES["service"]["steps"] if i == "USER"]
    assert users[-1].split(":")[0] not in ("root", "0")


def test_images_install_only_their_extras() -> None:
    collector = installed_extras("collector")
    assert collector == {"collector"}
    names = requirement_names(collector)
    assert not names & {"fastapi", "uvicorn", "onnxruntime", "onnxruntime-gpu", "torch"}, names
    assert "nvidia-ml-py" in names
    service = installed_extras("service")
    assert "service" in service and not service & {"train", "dev", "demo"}
    names = requirement_names(service)
    assert "torch" not in names and {"fastapi", "onnxruntime"} <= names
    for text in pip_installs("collector"):
        assert not re.search(r"fastapi|onnxruntime|torch", text), text


def _ignore_regex(pattern: str) -> re.Pattern[str]:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        elif pattern[i] == "[":
            end = pattern.index("]", i)
            out, i = out + pattern[i : end + 1], end + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + r"\Z")


def dockerignored(rel: str) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents wins."""
    patterns = [
        ln.strip()
        for ln in DOCKERIGNORE.read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]
    parts = rel.split("/")
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    ignored = False
    for pat in patterns:
        negate = pat.startswith("!")
        regex = _ignore_regex(pat.lstrip("!").strip("/"))
        if any(regex.match(p) for p in prefixes):
            ignored = not negate
    return ignored


def source_folders() -> tuple[str, ...]:
    """The folders setup.py installs as oomcast.* (its ``TOP``)."""
    import ast

    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "TOP":
            value = ast.literal_eval(node.value)
            assert isinstance(value, tuple)
            return value
    raise AssertionError("setup.py has no TOP")


def test_dockerignore_keeps_the_context_small_but_buildable() -> None:
    for rel in (
        "data/sim/train/0001.jsonl.gz",
        "runs/latest/checkpoint.pt",
        ".venv/bin/python",
        ".git/HEAD",
        "tests/conftest.py",
        ".pytest_cache/v/cache/lastfailed",
        ".ruff_cache/CACHEDIR.TAG",
        "service/__pycache__/cli.cpython-311.pyc",
        "oomcast.egg-info/PKG-INFO",
        "deploy/compose.yaml",
    ):
        assert dockerignored(rel), rel
    needed = ["pyproject.toml", "setup.py", PYPROJECT["project"]["readme"]]
    for folder in source_folders():
        needed.append(f"{folder}/__init__.py")
    for package, globs in PYPROJECT["tool"]["setuptools"]["package-data"].items():
        folder = package.removeprefix("oomcast.").replace(".", "/")
        for pattern in globs:
            needed += [str(p.relative_to(ROOT)) for p in (ROOT / folder).glob(pattern)]
    assert "model/oomcast-lstm.onnx" in needed
    for rel in needed:
        assert not dockerignored(rel), rel


# ---------------------------------------------------------------------------------------------
# Each agent gets its own node's key, never the master secret (issue 31, item 6)
# ---------------------------------------------------------------------------------------------


def _daemonset_objects() -> list[dict[str, Any]]:
    if shutil.which("kubectl") is not None:
        out = subprocess.run(
            ["kubectl", "kustomize", str(KUBE)],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
        return [d for d in yaml.safe_load_all(out) if d]
    return [d for d in yaml.safe_load_all((KUBE / "agent-daemonset.yaml").read_text()) if d]


def test_the_agent_daemonset_holds_its_nodes_key_file_and_no_master_secret() -> None:
    """The shipped DaemonSet gave every agent the master control secret, which signs for
    every node. Now the agent reads its node's own key from a file on the node, mounted read
    only, and nothing in its pod names the service's Secret."""
    (ds,) = [d for d in _daemonset_objects() if d["kind"] == "DaemonSet"]
    spec = ds["spec"]["template"]["spec"]
    (agent,) = spec["containers"]
    env = {e["name"]: e for e in agent.get("env", [])}
    assert "OOMCAST_CONTROL_SECRET" not in env
    assert "oomcast-service" not in json.dumps(spec)  # the service's Secret, with the master
    path = env["OOMCAST_NODE_KEY_FILE"]["value"]
    (mount,) = [m for m in agent["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
    assert mount["readOnly"] is True
    (vol,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    assert vol["hostPath"]["path"] == mount["mountPath"]


def test_provision_node_keys_writes_each_nodes_own_key_only(tmp_path: Path) -> None:
    """deploy/kubernetes/provision-node-keys.sh, with a stand-in for kubectl (there is no
    cluster here) that lists two GPU nodes and runs each `kubectl debug node/...` command
    against a directory per node standing in for the node's root: each node ends up with
    its own key, mode 0400, and the master secret is written nowhere."""
    from oomcast.model.control import node_key

    master = "m" * 64
    roots = tmp_path / "nodes"
    fake = tmp_path / "bin" / "kubectl"
    fake.parent.mkdir()
    fake.write_text(
        "#!/usr/bin/env bash\n"
        'case "$1" in\n'
        '  get) if [ "$2" = nodes ]; then echo -n "gpu-a gpu-b"; fi ;;\n'
        '  debug) node="${2#node/}"; shift 2\n'
        '    while [ "$1" != -- ]; do shift; done; shift\n'
        f'    root="{roots}/$node"; mkdir -p "$root"\n'
        '    "$1" "$2" "${3//\\/host\\//$root/}" ;;\n'
        "esac\n"
    )
    fake.chmod(0o755)
    bin_dir = Path(oomcast_bin()).parent
    env = {"PATH": f"{fake.parent}:{bin_dir}:/usr/bin:/bin", "OOMCAST_CONTROL_SECRET": master}
    done = subprocess.run(
        [str(KUBE / "provision-node-keys.sh")], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    for node in ("gpu-a", "gpu-b"):
        key_file = roots / node / "etc" / "oomcast" / "node-key"
        assert key_file.read_text().strip() == node_key(master, node)
        assert key_file.stat().st_mode & 0o777 == 0o400
    written = "".join(p.read_text() for p in roots.rglob("*") if p.is_file())
    assert master not in written
    no_secret = {k: v for k, v in env.items() if k != "OOMCAST_CONTROL_SECRET"}
    refused = subprocess.run(
        [str(KUBE / "provision-node-keys.sh")],
        env=no_secret,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode != 0 and "OOMCAST_CONTROL_SECRET" in refused.stderr


def oomcast_bin() -> str:
    import sys

    return str(Path(sys.executable).parent / "oomcast")
