#!/usr/bin/env python3
"""Compares a rendering of charts/whereabouts with the kustomize objects it must equal.

    helm_compare.py ACTUAL.yaml --expect A.yaml [--minus B.yaml] [--expect C.yaml] [edits...]

The expected objects are built from the kustomize renderings in the order given: --expect adds
(or replaces) every object of a file, --minus removes every object of a file (by key); then
--drop KIND/NAME removes that object (Namespace/whereabouts-system: namespace.create). The edits
below then say what a non-default value changes; everything else must stay as kustomize has it.
Objects are matched by apiVersion/kind/namespace/name and compared whole, after removing from
the chart's objects only the labels and annotations Helm adds (CHART_KEYS). Prints a diff of
every missing, extra or different object and exits 1; exits 0 when they are the same.

Edits of the expected objects (each mirrors one chart value):
  --namespace NS        the release namespace: every string "whereabouts-system" becomes NS
  --operator-namespace NS
                        operator.namespace: the operator's objects, the references to them
                        (subjects, the webhook's Service, certificate names, monitoring
                        selectors) and its Namespace move from whereabouts-operator to NS
  --pool-namespace NS   Roles and RoleBindings in kube-system move to NS (not those that read
                        upstream's objects, UPSTREAM_ROLES, which stay where upstream puts them);
                        --pool-namespace=NS
  --no-agent            the node DaemonSet loses its agent container and agent-socket volume
  --image IMAGE         every container's image
  --pull-policy POLICY  every container's imagePullPolicy
  --set KIND/NAME:PATH=YAML   one field; PATH is dot-separated, a list item is picked by name:
                        'Deployment/whereabouts-operator:spec.template.spec.containers[operator].resources={}'
"""

import argparse
import difflib
import re
import sys

import yaml

# The operator's Role (and RoleBinding) that reads upstream whereabouts' components, which live in
# kube-system whatever the pool namespace (src/controller/migration/upstream.rs).
UPSTREAM_ROLES = {"whereabouts-operator-upstream"}

# What Helm's chart labels add (templates/_helpers.tpl, whereabouts.chartLabels): nothing else may differ.
CHART_KEYS = (
    "helm.sh/chart",
    "app.kubernetes.io/managed-by",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/version",
)


def key(obj):
    meta = obj.get("metadata") or {}
    return "{}/{}/{}/{}".format(
        obj.get("apiVersion"), obj.get("kind"), meta.get("namespace", ""), meta.get("name")
    )


def load(path):
    """The objects of a multi-document YAML file, by key; a key seen twice is an error."""
    objs = {}
    with open(path) as f:
        for doc in yaml.safe_load_all(f):
            if doc is None:
                continue
            k = key(doc)
            if k in objs:
                sys.exit(f"helm_compare: {path}: {k} appears twice")
            objs[k] = doc
    return objs


def strip_chart_metadata(obj):
    meta = obj.get("metadata") or {}
    for field in ("labels", "annotations"):
        values = meta.get(field)
        if values is None:
            continue
        for k in CHART_KEYS:
            values.pop(k, None)
        if not values:
            del meta[field]
    return obj


def replace_strings(node, old, new):
    if isinstance(node, dict):
        return {k: replace_strings(v, old, new) for k, v in node.items()}
    if isinstance(node, list):
        return [replace_strings(v, old, new) for v in node]
    if isinstance(node, str):
        return node.replace(old, new)
    return node


OPERATOR_NS = "whereabouts-operator"


def move_operator_namespace(node, ns, key=None):
    """Moves what lives in (or names) the operator's namespace to NS. Only namespace fields and
    names built from it change: the operator's own objects share the namespace's name."""
    if isinstance(node, dict):
        moved = {k: move_operator_namespace(v, ns, k) for k, v in node.items()}
        if moved.get("kind") == "Namespace" and moved["metadata"]["name"] == OPERATOR_NS:
            moved["metadata"]["name"] = ns
        return moved
    if isinstance(node, list):
        return [move_operator_namespace(v, ns, key) for v in node]
    if isinstance(node, str):
        if key in ("namespace", "matchNames") and node == OPERATOR_NS:
            return ns
        return (node.replace(f".{OPERATOR_NS}.svc", f".{ns}.svc")
                .replace(f"{OPERATOR_NS}/whereabouts-webhook", f"{ns}/whereabouts-webhook"))
    return node


def pod_specs(obj):
    spec = (obj.get("spec") or {}).get("template", {}).get("spec")
    return [spec] if spec else []


def containers(obj):
    for spec in pod_specs(obj):
        for field in ("initContainers", "containers"):
            yield from spec.get(field) or []


def by_kind_name(objs, kind_name):
    kind, name = kind_name.split("/", 1)
    found = [o for o in objs.values() if o["kind"] == kind and o["metadata"]["name"] == name]
    if len(found) != 1:
        sys.exit(f"helm_compare: --set {kind_name}: {len(found)} objects match, want 1")
    return found[0]


def set_path(obj, path, value):
    """Sets PATH (a.b.list[name].c) in obj, creating missing mappings."""
    parts = re.findall(r"[^.\[]+(?:\[[^\]]*\])?", path)
    node = obj
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if part.endswith("]"):
            field, name = part[:-1].split("[", 1)
            items = [c for c in node.get(field) or [] if c.get("name") == name]
            if len(items) != 1:
                sys.exit(f"helm_compare: --set {path}: no single item {name!r} in {field}")
            if last:
                sys.exit(f"helm_compare: --set {path}: cannot replace a list item")
            node = items[0]
        elif last:
            node[part] = value
        else:
            node = node.setdefault(part, {})


def apply_edits(objs, args):
    if args.namespace:
        objs = {k: replace_strings(o, "whereabouts-system", args.namespace) for k, o in objs.items()}
        objs = {key(o): o for o in objs.values()}
    if args.operator_namespace:
        objs = {k: move_operator_namespace(o, args.operator_namespace) for k, o in objs.items()}
        objs = {key(o): o for o in objs.values()}
    if args.pool_namespace:
        for o in objs.values():
            if (o["kind"] in ("Role", "RoleBinding") and o["metadata"].get("namespace") == "kube-system"
                    and o["metadata"]["name"] not in UPSTREAM_ROLES):
                o["metadata"]["namespace"] = args.pool_namespace
        objs = {key(o): replace_strings(o, "--pool-namespace=kube-system",
                                        f"--pool-namespace={args.pool_namespace}")
                for o in objs.values()}
    if args.no_agent:
        ds = by_kind_name(objs, "DaemonSet/whereabouts-node")
        spec = pod_specs(ds)[0]
        spec["containers"] = [c for c in spec["containers"] if c["name"] != "agent"]
        spec["volumes"] = [v for v in spec["volumes"] if v["name"] != "agent-socket"]
    for o in objs.values():
        for c in containers(o):
            if args.image:
                c["image"] = args.image
            if args.pull_policy:
                c["imagePullPolicy"] = args.pull_policy
    for edit in args.set:
        target, _, assignment = edit.partition(":")
        path, _, value = assignment.partition("=")
        set_path(by_kind_name(objs, target), path, yaml.safe_load(value))
    return objs


def dump(obj):
    return yaml.safe_dump(obj, sort_keys=True, default_flow_style=False, width=1000).splitlines(keepends=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("actual", help="the chart's rendering (helm template --include-crds)")
    p.add_argument("--expect", action="append", default=[], dest="steps", type=lambda f: ("+", f))
    p.add_argument("--minus", action="append", default=[], dest="steps", type=lambda f: ("-", f))
    p.add_argument("--drop", action="append", default=[], help="KIND/NAME of an object to remove")
    p.add_argument("--namespace")
    p.add_argument("--operator-namespace")
    p.add_argument("--pool-namespace")
    p.add_argument("--no-agent", action="store_true")
    p.add_argument("--image")
    p.add_argument("--pull-policy")
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--label", default="", help="names this comparison in the output")
    args = p.parse_args()

    expected = {}
    for op, path in args.steps:
        objs = load(path)
        if op == "+":
            expected.update(objs)
        else:
            for k in objs:
                if k not in expected:
                    sys.exit(f"helm_compare: --minus {path}: {k} is not expected anyway")
                del expected[k]
    drop = set(args.drop)
    expected = {k: o for k, o in expected.items()
                if f'{o["kind"]}/{o["metadata"]["name"]}' not in drop}
    expected = apply_edits(expected, args)
    actual = {k: strip_chart_metadata(o) for k, o in load(args.actual).items()}

    failures = []
    for k in sorted(expected.keys() - actual.keys()):
        failures.append(f"missing from the chart: {k}\n")
    for k in sorted(actual.keys() - expected.keys()):
        failures.append(f"only in the chart: {k}\n")
    for k in sorted(expected.keys() & actual.keys()):
        if expected[k] != actual[k]:
            diff = difflib.unified_diff(dump(expected[k]), dump(actual[k]),
                                        f"expected {k}", f"chart {k}")
            failures.append(f"differs: {k}\n" + "".join(diff))

    label = f"[{args.label}] " if args.label else ""
    if failures:
        sys.stdout.write("".join(f"{label}{f}" for f in failures))
        print(f"{label}FAIL: {len(failures)} of {len(expected.keys() | actual.keys())} objects differ")
        return 1
    print(f"{label}ok: {len(actual)} objects equal")
    return 0


if __name__ == "__main__":
    sys.exit(main())
