#!/usr/bin/env python3
"""The checks behind scripts/check/check-deploy.sh that need Python: schema validation of the rendered
manifests, the cross-references between them, extraction of every PromQL expression for promtool,
and the comparison of the metric names those expressions query with what a real retrace exports.

It also serves the check's stand-in for a vLLM server (fake-vllm), so that a remote PRM's
metrics appear on the scrape. Run by check-deploy.sh inside its tools venv (kubernetes-validate,
cloudcoil's prometheus-operator models, PyYAML); each subcommand exits non-zero on the first class
of failure it finds, after printing every instance of it.
"""

import argparse
import json
import re
import sys
import tomllib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import yaml

# Kubernetes versions the manifests must be valid for: the oldest still supported upstream that has
# every field used here (preStop `sleep`, unhealthyPodEvictionPolicy), and the newest schemas the
# validator ships.
K8S_VERSIONS = ["1.31.0", "1.37.0"]

# Series that Prometheus itself writes for every target, which no exporter can list.
PROMETHEUS_SERIES = {"up"}

README_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*$")
# Where every alert's runbook_url points: a heading of docs/operating.md, as GitHub serves it.
RUNBOOK_PREFIX = "https://github.com/retrace-project/retrace/blob/main/docs/operating.md#"


def load_docs(path):
    return [d for d in yaml.safe_load_all(Path(path).read_text()) if d]


def fail(problems, what):
    if problems:
        for p in problems:
            print(f"FAIL {what}: {p}")
        sys.exit(1)


# --- manifests ----------------------------------------------------------------------------------


def crd_problems(doc):
    """Validates a prometheus-operator object against models generated from its CRD's schema
    (types, required fields, the duration patterns), then finds keys the models dropped: pydantic
    ignores unknown keys, and an unknown key is what a typo in a CRD looks like."""
    from cloudcoil.models.prometheus_operator import v1

    model = {"ServiceMonitor": v1.ServiceMonitor, "PrometheusRule": v1.PrometheusRule}.get(doc["kind"])
    if model is None:
        return [f"no schema for {doc['apiVersion']} {doc['kind']}"]
    try:
        parsed = model.model_validate(doc)
    except Exception as e:  # pydantic's ValidationError lists every field at fault
        return [f"{doc['kind']}/{doc['metadata']['name']}: {e}"]
    kept = parsed.model_dump(by_alias=True, exclude_unset=True, mode="json")
    return [f"{doc['kind']}/{doc['metadata']['name']}: unknown field {p}" for p in dropped(doc, kept, "")]


def dropped(given, kept, path):
    if isinstance(given, dict):
        for k, v in given.items():
            if not isinstance(kept, dict) or k not in kept:
                yield f"{path}.{k}"
            else:
                yield from dropped(v, kept[k], f"{path}.{k}")
    elif isinstance(given, list) and isinstance(kept, list):
        for i, (g, k) in enumerate(zip(given, kept)):
            yield from dropped(g, k, f"{path}[{i}]")


def schema_problems(docs, label):
    import kubernetes_validate

    problems = []
    for doc in docs:
        name = f"{label}: {doc['kind']}/{doc['metadata']['name']}"
        found = []
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            found += [f"{label}: {p}" for p in crd_problems(doc)]
            how = "prometheus-operator CRD models"
        else:
            how = "Kubernetes " + ", ".join(K8S_VERSIONS) + " (strict)"
            for version in K8S_VERSIONS:
                try:
                    kubernetes_validate.validate(doc, version, strict=True)
                except kubernetes_validate.ValidationError as e:
                    found.append(f"{name} (Kubernetes {version}): {e.message} at {'.'.join(map(str, e.path))}")
                except kubernetes_validate.SchemaNotFoundError:
                    found.append(f"{name}: no schema for {doc['apiVersion']} in Kubernetes {version}")
        if not found:
            print(f"ok   schema {name}: {how}")
        problems += found
    return problems


def matches(selector, labels):
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def reference_problems(docs, label):
    """What a schema can't see: objects that must point at each other do."""
    by_kind = {}
    for d in docs:
        by_kind.setdefault(d["kind"], []).append(d)
    problems = []
    (deploy,) = by_kind["Deployment"]
    pod = deploy["spec"]["template"]
    pod_labels = pod["metadata"]["labels"]
    if not matches(deploy["spec"]["selector"]["matchLabels"], pod_labels):
        problems.append("Deployment selector does not match its pod template")
    ports = {p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}

    services = by_kind["Service"]
    if not any(s["spec"].get("clusterIP") == "None" for s in services):
        problems.append("no headless Service (clusterIP: None)")
    for s in services:
        if not matches(s["spec"]["selector"], pod_labels):
            problems.append(f"Service {s['metadata']['name']} selects no retrace pod")
        for p in s["spec"]["ports"]:
            if p["targetPort"] not in ports:
                problems.append(f"Service {s['metadata']['name']} targets unknown port {p['targetPort']}")

    for pdb in by_kind["PodDisruptionBudget"]:
        if not matches(pdb["spec"]["selector"]["matchLabels"], pod_labels):
            problems.append("PodDisruptionBudget selects no retrace pod")
    for hpa in by_kind["HorizontalPodAutoscaler"]:
        ref = hpa["spec"]["scaleTargetRef"]
        if (ref["kind"], ref["name"]) != ("Deployment", deploy["metadata"]["name"]):
            problems.append(f"HPA scales {ref['kind']}/{ref['name']}, not the Deployment")
        if "replicas" in deploy["spec"]:
            problems.append("Deployment sets replicas, which the HPA owns")

    for sm in by_kind["ServiceMonitor"]:
        picked = [s for s in services
                  if matches(sm["spec"]["selector"]["matchLabels"], s["metadata"].get("labels", {}))]
        if len(picked) != 1:
            problems.append(f"ServiceMonitor selects {len(picked)} Services; each pod must be scraped once")
        for ep in sm["spec"]["endpoints"]:
            if picked and ep["port"] not in {p["name"] for p in picked[0]["spec"]["ports"]}:
                problems.append(f"ServiceMonitor scrapes port {ep['port']}, which its Service lacks")

    # The grace period must outlast the preStop sleep plus retrace's own drain.
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    cm_name = volumes["config"]["configMap"]["name"]
    (cm,) = [c for c in by_kind["ConfigMap"] if c["metadata"]["name"] == cm_name]
    config = tomllib.loads(cm["data"]["retrace.toml"])
    (container,) = pod["spec"]["containers"]
    sleep = container.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
    grace = pod["spec"]["terminationGracePeriodSeconds"]
    drain = config["server"].get("shutdown_grace_s", 30)
    if grace <= sleep + drain:
        problems.append(f"terminationGracePeriodSeconds {grace} <= preStop {sleep} s + shutdown_grace_s {drain}")
    print(f"ok   references {label}: grace {grace} s > preStop {sleep} s + shutdown_grace_s {drain} s")

    res = container["resources"]
    gpus = res.get("limits", {}).get("nvidia.com/gpu")
    if gpus is not None:
        if res.get("requests", {}).get("nvidia.com/gpu") != gpus:
            problems.append("nvidia.com/gpu requests differ from limits")
        if not pod["spec"].get("nodeSelector"):
            problems.append("a GPU pod without a nodeSelector")
        if not all(e.get("device", "cpu").startswith("cuda") for e in config["evaluator"] if e["kind"] == "prm"):
            problems.append("a GPU pod whose PRM evaluators are not on cuda")
    dash = [c for c in by_kind["ConfigMap"] if c["metadata"].get("labels", {}).get("grafana_dashboard") == "1"]
    if len(dash) != 1:
        problems.append(f"{len(dash)} ConfigMaps carry the grafana_dashboard label, not 1")
    return [f"{label}: {p}" for p in problems]


def dashboard_problems(dash):
    """Grafana ships no offline validator: check what breaks a dashboard silently instead (ids,
    refIds, the grid, variables a query names but the dashboard lacks)."""
    problems, ids, cells = [], set(), {}
    variables = {v["name"] for v in dash["templating"]["list"]} | {"__rate_interval", "__interval"}
    for key in ("uid", "title", "panels", "schemaVersion"):
        if key not in dash:
            problems.append(f"no {key}")
    for p in dash["panels"]:
        if p["id"] in ids:
            problems.append(f"panel id {p['id']} twice")
        ids.add(p["id"])
        g = p["gridPos"]
        if g["x"] + g["w"] > 24:
            problems.append(f"panel {p['title']!r} overflows the 24-column grid")
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                if (x, y) in cells:
                    problems.append(f"panel {p['title']!r} overlaps {cells[(x, y)]!r}")
                    break
                cells[(x, y)] = p["title"]
            else:
                continue
            break
        refs = [t["refId"] for t in p.get("targets", [])]
        if len(refs) != len(set(refs)):
            problems.append(f"panel {p['title']!r} repeats a refId")
        if p["type"] != "row" and not refs:
            problems.append(f"panel {p['title']!r} has no query")
        for t in p.get("targets", []):
            for v in re.findall(r"\$\{?(\w+)", t["expr"]):
                if v not in variables:
                    problems.append(f"panel {p['title']!r} uses undefined variable ${v}")
    return problems


def cmd_manifests(args):
    problems = []
    for path in args.rendered:
        docs = load_docs(path)
        problems += schema_problems(docs, Path(path).stem)
        problems += reference_problems(docs, Path(path).stem)
        dash = dashboard(docs)
        found = dashboard_problems(dash)
        problems += [f"{Path(path).stem}: dashboard: {p}" for p in found]
        if not found:
            print(f"ok   dashboard {Path(path).stem}: {len(dash['panels'])} panels, ids, grid and variables consistent")
    fail(problems, "manifests")


# --- PromQL -------------------------------------------------------------------------------------


def dashboard(docs):
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and "grafana_dashboard" in d["metadata"].get("labels", {})]
    (text,) = cm["data"].values()
    return json.loads(text)


def dashboard_exprs(dash):
    """(where, expr) for every panel target and query variable."""
    out = []
    def walk(panels):
        for p in panels:
            for t in p.get("targets", []):
                out.append((f"panel {p['title']!r} {t['refId']}", t["expr"]))
            walk(p.get("panels", []))
    walk(dash["panels"])
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            out.append((f"variable {v['name']}", q))
    return out


def grafana_to_promql(expr):
    """Grafana's variables replaced by values of the same shape, so promtool can parse the rest;
    label_values(series, label), a Grafana function, becomes its series selector."""
    m = re.fullmatch(r"\s*label_values\((.*),\s*[a-zA-Z_]\w*\)\s*", expr)
    if m:
        expr = m.group(1)
    expr = expr.replace("$__rate_interval", "5m").replace("$__interval", "1m")
    return re.sub(r"\$\{?\w+\}?", "x", expr)


def adapter_names(path):
    """The custom metric each adapter rule serves: its `name.as`, else the series it selects."""
    out = []
    for rule in yaml.safe_load(Path(path).read_text())["rules"]:
        series = re.match(r"[\w:]+", rule["seriesQuery"]).group(0)
        out.append(rule.get("name", {}).get("as") or series)
    return out


def adapter_exprs(path):
    out = []
    for i, rule in enumerate(yaml.safe_load(Path(path).read_text())["rules"]):
        out.append((f"adapter rule {i} seriesQuery", rule["seriesQuery"]))
        # The adapter's template as it would be filled for an HPA asking about a namespace's pods.
        q = (rule["metricsQuery"].replace("<<.Series>>", re.match(r"[\w:]+", rule["seriesQuery"]).group(0))
             .replace("<<.LabelMatchers>>", 'namespace="retrace",pod=~"retrace-.*"')
             .replace("<<.GroupBy>>", "pod"))
        out.append((f"adapter rule {i} metricsQuery", q))
    return out


def cmd_extract(args):
    """Writes rules.yaml (the PrometheusRule's spec, for promtool check/test rules) and
    queries.yaml: the dashboard's and the adapter's expressions as recording rules, so that promtool
    parses them with Prometheus's own parser too."""
    docs = load_docs(args.rendered)
    out = Path(args.out)
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    (out / "rules.yaml").write_text(yaml.safe_dump(rule["spec"], sort_keys=False))
    exprs = [(w, grafana_to_promql(e)) for w, e in dashboard_exprs(dashboard(docs))] + adapter_exprs(args.adapter)
    rules = [{"record": f"check:query_{i}", "expr": e} for i, (_, e) in enumerate(exprs)]
    (out / "queries.yaml").write_text(
        yaml.safe_dump({"groups": [{"name": "queries", "rules": rules}]}, sort_keys=False))
    print(f"ok   extracted {sum(len(g['rules']) for g in rule['spec']['groups'])} alert rules, "
          f"{len(rules)} dashboard and adapter queries")


KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right",
            "bool", "offset", "inf", "nan", "atan2"}


def metric_names(expr):
    """Metric names a PromQL expression selects. Strings, label matchers, ranges, grouping
    clauses, numbers and function names are removed first; what is left that looks like an
    identifier is a series selector."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)
    s = re.sub(r"\{[^}]*\}", " ", s)
    s = re.sub(r"\[[^\]]*\]", " ", s)
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    s = re.sub(r"(?<![\w:])\d+(\.\d+)?([eE][+-]?\d+)?[smhdwy]*\b", " ", s)
    names = set()
    for m in re.finditer(r"[a-zA-Z_:][\w:]*", s):
        if m.group(0).lower() in KEYWORDS or re.match(r"\s*\(", s[m.end():]):
            continue
        names.add(m.group(0))
    return names


def self_test():
    cases = {
        'histogram_quantile(0.99, sum by (evaluator, le) (rate(a_seconds_bucket{x="y,z"}[5m]))) > 10':
            {"a_seconds_bucket"},
        'sum by (judge) (rate(b_total{outcome=~"ok|c_total"}[1m])) / on(judge) group_left(pod) c_info':
            {"b_total", "c_info"},
        'up{job="retrace"} == 0 and d_gauge offset 5m > 1e3': {"up", "d_gauge"},
    }
    for expr, want in cases.items():
        got = metric_names(expr)
        assert got == want, f"metric_names({expr!r}) = {got}, want {want}"


def exported(metrics_text):
    """Sample names on the scrape, and the type of each family."""
    samples, types = set(), {}
    for line in metrics_text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            types[name] = kind
        elif line and not line.startswith("#"):
            samples.add(re.match(r"[a-zA-Z_:][\w:]*", line).group(0))
    return samples, types


def cmd_metrics(args):
    self_test()
    docs = load_docs(args.rendered)
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    exprs = [(f"alert {r['alert']}", r["expr"]) for g in rule["spec"]["groups"] for r in g["rules"]]
    exprs += [(w, grafana_to_promql(e)) for w, e in dashboard_exprs(dashboard(docs))]
    exprs += adapter_exprs(args.adapter)
    samples, types = exported(Path(args.scrape).read_text())
    problems, used = [], set()
    # An HPA's pods metric is what an adapter rule serves (whose queries are checked below), not
    # necessarily a series retrace exports.
    served = adapter_names(args.adapter)
    for hpa in (d for d in docs if d["kind"] == "HorizontalPodAutoscaler"):
        for m in (m for m in hpa["spec"]["metrics"] if m["type"] == "Pods"):
            if m["pods"]["metric"]["name"] not in served:
                problems.append(f"HPA metric {m['pods']['metric']['name']} is served by no adapter rule "
                                f"({', '.join(served)})")
    for where, expr in exprs:
        for name in metric_names(expr):
            used.add(name)
            if name in PROMETHEUS_SERIES:
                continue
            if name not in samples:
                problems.append(f"{where} queries {name}, which retrace does not export")
                continue
            base, suffix = re.match(r"(.*?)(_bucket|_sum|_count)?$", name).groups()
            if suffix and types.get(name) is None and types.get(base) != "histogram":
                problems.append(f"{where} queries {name}, but {base} is a {types.get(base)}, not a histogram")
            if suffix == "_bucket" and types.get(base) != "histogram":
                problems.append(f"{where} queries {name} as a histogram's buckets, but {base} is not one")
    families = sorted({re.sub(r"_(bucket|sum|count)$", "", n)
                       if types.get(re.sub(r"_(bucket|sum|count)$", "", n)) == "histogram" else n
                       for n in used})
    print(f"ok   {len(exprs)} expressions query {len(families)} metrics: {' '.join(families)}")
    unused = sorted(set(types) - set(families))
    if unused:
        print(f"note exported but not on the dashboard or in an alert: {' '.join(unused)}")
    fail(problems, "metric names")


def slug(heading):
    """The anchor a Markdown renderer gives a heading: lowercased, punctuation dropped, spaces
    to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def cmd_runbooks(args):
    docs = load_docs(args.rendered)
    anchors, fenced = set(), False
    for line in Path(args.readme).read_text().splitlines():
        fenced ^= line.startswith("```")
        if not fenced and (m := README_HEADING.match(line)):
            anchors.add(slug(m.group(1)))
    problems = []
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    for g in rule["spec"]["groups"]:
        for r in g["rules"]:
            url = r.get("annotations", {}).get("runbook_url", "")
            anchor = url[len(RUNBOOK_PREFIX):] if url.startswith(RUNBOOK_PREFIX) else ""
            if not anchor or anchor not in anchors:
                problems.append(f"alert {r['alert']}: runbook_url {url!r} names no heading of {args.readme} "
                                f"under {RUNBOOK_PREFIX}")
            if r["alert"] not in r["annotations"].get("description", ""):
                problems.append(f"alert {r['alert']}: its description does not name its runbook")
            if r.get("labels", {}).get("severity") not in {"critical", "warning", "info"}:
                problems.append(f"alert {r['alert']}: no severity label")
            if "for" not in r:
                problems.append(f"alert {r['alert']}: no `for:`")
    fail(problems, "runbooks")
    print(f"ok   every alert has a severity, a `for:`, and a runbook_url naming a heading of {args.readme}")


def cmd_without_k8s_sd(args):
    """A copy of a Prometheus config with kubernetes_sd_configs replaced by an equivalent static
    target, for a promtool built without Kubernetes discovery."""
    config = yaml.safe_load(Path(args.config).read_text())
    problems = []
    for job in config["scrape_configs"]:
        blocks = job.pop("kubernetes_sd_configs", None)
        if blocks is None:
            continue
        for b in blocks:
            if b.get("role") not in {"node", "service", "pod", "endpoints", "endpointslice", "ingress"}:
                problems.append(f"job {job['job_name']}: kubernetes_sd_configs role {b.get('role')!r}")
            unknown = set(b) - {"role", "namespaces", "selectors", "api_server", "kubeconfig_file", "attach_metadata"}
            problems += [f"job {job['job_name']}: unknown kubernetes_sd_configs key {k}" for k in sorted(unknown)]
        job["static_configs"] = [{"targets": ["127.0.0.1:9091"]}]
        print(f"note job {job['job_name']}: kubernetes_sd_configs ({len(blocks)} block(s), roles ok) "
              "checked here, the rest by promtool")
    fail(problems, "prometheus.yml")
    Path(args.out).write_text(yaml.safe_dump(config, sort_keys=False))


# --- a vLLM-shaped upstream -----------------------------------------------------------------------


class FakeVllm(BaseHTTPRequestHandler):
    """Answers the two requests src/prm/remote.rs sends, in vLLM's shapes: POST /pooling (a
    token_classify task: ALL pooling, one [p_wrong, p_right] row per input token) and POST
    /v1/completions with prompt_logprobs (one entry per prompt token, the first null, each
    listing only the prompt's own token, as vLLM does when the top-k leaves out + and -, so
    the PRM scores those steps from a bound and counts them inexact)."""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/pooling" and body.get("task") == "token_classify":
            rows = [[0.25, 0.75] for _ in body["input"]]
            reply = {"id": "pool-0", "object": "list", "created": 0, "model": "prm",
                     "data": [{"index": 0, "object": "pooling", "data": rows}]}
        elif self.path == "/v1/completions" and "prompt_logprobs" in body:
            entries = [None] + [{str(t): {"logprob": -0.5, "rank": 1, "decoded_token": "x"}}
                                for t in body["prompt"][1:]]
            reply = {"id": "cmpl-0", "object": "text_completion", "created": 0, "model": "prm",
                     "choices": [{"index": 0, "text": "+", "finish_reason": "length", "prompt_logprobs": entries}]}
        else:
            self.send_error(404, f"fake vLLM: no route for POST {self.path}")
            return
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def cmd_fake_vllm(args):
    ThreadingHTTPServer(("127.0.0.1", args.port), FakeVllm).serve_forever()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(required=True)
    a = sub.add_parser("manifests", help="schema and cross-reference checks of rendered overlays")
    a.add_argument("rendered", nargs="+")
    a.set_defaults(run=cmd_manifests)
    a = sub.add_parser("extract", help="write rules.yaml and queries.yaml for promtool")
    a.add_argument("rendered")
    a.add_argument("adapter")
    a.add_argument("out")
    a.set_defaults(run=cmd_extract)
    a = sub.add_parser("metrics", help="compare queried metric names with a scrape")
    a.add_argument("rendered")
    a.add_argument("adapter")
    a.add_argument("scrape")
    a.set_defaults(run=cmd_metrics)
    a = sub.add_parser("runbooks", help="every alert's runbook_url names a heading of docs/operating.md")
    a.add_argument("rendered")
    a.add_argument("readme", help="the runbooks' page, docs/operating.md")
    a.set_defaults(run=cmd_runbooks)
    a = sub.add_parser("without-k8s-sd", help="a Prometheus config with static targets for Kubernetes discovery")
    a.add_argument("config")
    a.add_argument("out")
    a.set_defaults(run=cmd_without_k8s_sd)
    a = sub.add_parser("fake-vllm", help="serve vLLM's /pooling and /v1/completions shapes on 127.0.0.1:PORT")
    a.add_argument("port", type=int)
    a.set_defaults(run=cmd_fake_vllm)
    args = p.parse_args()
    args.run(args)


if __name__ == "__main__":
    main()
