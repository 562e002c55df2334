"""Observability against a real Prometheus (docs/metrics.md, docker/prometheus, docker/grafana):
two sidecars of one job on loopback, driven by a trainer per rank for a few dozen steps (dgc, a
periodic full-sync, one NaN step), scraped every second by Debian's `prometheus` with the repo's
alert rules loaded. Then every PromQL expression of the Grafana dashboard (panels, annotations,
template variables) and of every alert rule is evaluated through Prometheus's HTTP API: it must
evaluate, name only metrics the sidecars expose, and (panels) return data. `promtool check metrics`
must pass on each sidecar's /metrics, and scripts/check-prometheus.sh (promtool check config,
check rules, test rules) must succeed.

Cheaper static checks (no processes) cover the shape of the dashboard and provisioning files and
that docs/metrics.md documents every family and every runbook anchor the alerts point to."""

import json
import math
import os
import re
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import numpy as np
import pytest

from conftest import REPO, free_tcp_port, metric_total, poll_until, tls_flags

yaml = pytest.importorskip("yaml")

PROMETHEUS = os.environ.get("LIGHTWIRE_PROMETHEUS") or "/usr/bin/prometheus"
PROMTOOL = os.environ.get("LIGHTWIRE_PROMTOOL") or "/usr/bin/promtool"
DASHBOARD = os.path.join(REPO, "docker", "grafana", "dashboards", "lightwire-compression-health.json")
PROVISIONING = os.path.join(REPO, "docker", "grafana", "provisioning")
PROM_DIR = os.path.join(REPO, "docker", "prometheus")
ALERTS = os.path.join(PROM_DIR, "alerts.yml")
METRICS_DOC = os.path.join(REPO, "docs", "metrics.md")
CHECK_SCRIPT = os.path.join(REPO, "scripts", "check-prometheus.sh")

JOB = "lightwire"          # the scrape job, as in docker/prometheus/prometheus.yml
STEPS = 40
STEP_PAUSE = 0.25          # about 10 s of training
NAN_STEP = 20
TENSORS = {"layer.0.weight": 8192, "layer.0.bias": 256}

# Series Prometheus makes up itself for every target (not exposed by the sidecars).
SYNTHETIC = {"up", "scrape_duration_seconds", "scrape_samples_scraped",
             "scrape_samples_post_metric_relabeling", "scrape_series_added"}


# ------------------------------------------------------------------------------------------------
# PromQL helpers
# ------------------------------------------------------------------------------------------------
_PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool",
                 "and", "or", "unless", "inf", "nan"}


def promql_metric_names(expr):
    """The metric names an expression selects (not its functions, aggregations, labels or
    keywords). Enough PromQL for our expressions: strings, label matchers, ranges, grouping
    clauses, offsets and numbers are stripped, then every remaining identifier not followed by
    `(` is a metric name."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', expr)
    s = re.sub(r"\{[^}]*\}", " ", s)
    s = re.sub(r"\[[^\]]*\]", " ", s)
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    s = re.sub(r"\boffset\s+-?[0-9a-zA-Z]+", " ", s)
    s = re.sub(r"(?<![A-Za-z0-9_:.])\d+(?:\.\d*)?(?:[eE][+-]?\d+)?", " ", s)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", s):
        if s[m.end():].lstrip().startswith("("):
            continue  # a function or an aggregation
        if m.group(0).lower() in _PROMQL_WORDS:
            continue
        names.add(m.group(0))
    return names


def test_promql_metric_names():
    """The name extraction the checks below rely on."""
    assert promql_metric_names(
        'histogram_quantile(0.99, sum by (le, stage) (rate(lightwire_stage_duration_seconds_bucket'
        '{job=~"$job", instance=~"$instance"}[5s])))') == {"lightwire_stage_duration_seconds_bucket"}
    assert promql_metric_names(
        "avg_over_time(a_b[10m]) < 0.5 * avg_over_time(a_b[6h] offset 15m) and on (job, group) "
        "(c_d > 1e-3) or vector(0)") == {"a_b", "c_d"}
    assert promql_metric_names("time() - process_start_time_seconds{x=\"y(z)\"}") == {
        "process_start_time_seconds"}
    assert promql_metric_names("sum(1 - up)") == {"up"}


def substitute(expr, window):
    """Grafana's variables as an "All" selection and a window covering the run."""
    return (expr.replace("$__rate_interval", window).replace("$__interval", window)
            .replace("$__range", window).replace("$job", ".*").replace("$instance", ".*"))


# ------------------------------------------------------------------------------------------------
# What the repo's files hold
# ------------------------------------------------------------------------------------------------
def load_dashboard():
    with open(DASHBOARD, encoding="utf-8") as f:
        return json.load(f)


def all_panels(dash):
    for p in dash["panels"]:
        yield p
        for q in p.get("panels", []):  # collapsed rows hold their panels
            yield q


def panel_targets(dash):
    """[(panel title, refId, expr)] of every query panel."""
    out = []
    for p in all_panels(dash):
        if p["type"] == "row":
            continue
        for t in p.get("targets", []):
            out.append((p["title"], t["refId"], t["expr"]))
    return out


def annotation_queries(dash):
    return [(a["name"], a["expr"]) for a in dash["annotations"]["list"] if "expr" in a]


def alert_rules():
    with open(ALERTS, encoding="utf-8") as f:
        doc = yaml.safe_load(f)
    return [r for g in doc["groups"] for r in g["rules"] if "alert" in r]


def github_anchor(heading):
    """The anchor GitHub gives a Markdown heading."""
    h = heading.strip().lower()
    h = re.sub(r"[^\w\- ]", "", h)
    return h.replace(" ", "-")


def doc_anchors():
    with open(METRICS_DOC, encoding="utf-8") as f:
        text = f.read()
    heads = re.findall(r"^#{1,6}\s+(.+?)\s*$", text, re.M)
    return text, {github_anchor(h) for h in heads}


# ------------------------------------------------------------------------------------------------
# Static checks (no processes)
# ------------------------------------------------------------------------------------------------
def test_dashboard_shape():
    dash = load_dashboard()
    assert dash["uid"] == "lightwire-health"
    assert dash["title"] == "lightwire \u2014 compression health"
    assert 36 <= dash["schemaVersion"] <= 39, dash["schemaVersion"]
    tvars = {v["name"]: v for v in dash["templating"]["list"]}
    assert set(tvars) == {"job", "instance"}, sorted(tvars)
    assert tvars["job"]["definition"] == "label_values(lightwire_steps_total, job)"
    assert tvars["instance"]["definition"] == 'label_values(lightwire_steps_total{job=~"$job"}, instance)'
    for v in tvars.values():
        assert v["query"]["query"] == v["definition"]
        assert v["includeAll"] and v["multi"] and v["allValue"] == ".*"
    ids = [p["id"] for p in all_panels(dash)]
    assert len(ids) == len(set(ids)), "duplicate panel ids: %r" % ids
    for p in all_panels(dash):
        assert {"h", "w", "x", "y"} <= set(p["gridPos"]) and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24, p
        if p["type"] == "row":
            continue
        assert p["type"] in ("timeseries", "stat"), (p["title"], p["type"])
        assert p["datasource"] == {"type": "prometheus", "uid": "prometheus"}, p["title"]
        assert p["targets"], "panel %r has no query" % p["title"]
        for t in p["targets"]:
            assert 'job=~"$job"' in t["expr"] and 'instance=~"$instance"' in t["expr"], (
                "panel %r: %s does not filter on $job and $instance" % (p["title"], t["expr"]))
            assert t["datasource"]["uid"] == "prometheus"
    names = {n for n, _ in annotation_queries(dash)}
    assert {"Rollbacks", "Full-syncs", "Anomalies"} <= names, names
    # The families the dashboard must chart: compression, step stages and results, policies, peers,
    # and the process.
    exprs = " ".join(e for _, _, e in panel_targets(dash))
    for family in ("lightwire_compression_ratio", "lightwire_raw_bytes_total", "lightwire_wire_bytes_total",
                   "lightwire_cosine_similarity", "lightwire_residual_norm", "lightwire_state_bytes",
                   "lightwire_stage_duration_seconds_bucket", "lightwire_steps_total",
                   "lightwire_anomalies_total", "lightwire_rollbacks_total", "lightwire_full_syncs_total",
                   "lightwire_bypass_active", "lightwire_reward", "lightwire_peer_up",
                   "lightwire_peer_rtt_seconds",
                   "process_cpu_seconds_total", "process_resident_memory_bytes"):
        assert family in exprs, "no panel shows %s" % family
    assert "histogram_quantile(0.5," in exprs and "histogram_quantile(0.99," in exprs


def test_grafana_provisioning():
    with open(os.path.join(PROVISIONING, "datasources", "prometheus.yml")) as f:
        ds = yaml.safe_load(f)
    (d,) = ds["datasources"]
    assert (d["uid"], d["type"], d["url"]) == ("prometheus", "prometheus", "http://prometheus:9090")
    with open(os.path.join(PROVISIONING, "dashboards", "lightwire.yml")) as f:
        prov = yaml.safe_load(f)
    (p,) = prov["providers"]
    assert p["type"] == "file" and p["options"]["path"] == "/var/lib/grafana/dashboards"


def test_prometheus_config_shape():
    with open(os.path.join(PROM_DIR, "prometheus.yml")) as f:
        cfg = yaml.safe_load(f)
    assert cfg["rule_files"] == ["alerts.yml"]
    assert cfg["global"]["scrape_interval"] == "15s"
    (job,) = cfg["scrape_configs"]
    assert job["job_name"] == JOB
    targets = [t for sc in job["static_configs"] for t in sc["targets"]]
    assert targets and all(t.endswith(":4782") for t in targets), targets


def test_alert_rules_shape_and_runbooks():
    """Every alert: a severity, summary and description naming the instance, and a runbook anchor
    that exists in docs/metrics.md."""
    rules = alert_rules()
    assert {r["alert"] for r in rules} == {
        "LightwirePeerDown", "LightwireBypassStuck", "LightwireRollbackStorm",
        "LightwireLowCosineSimilarity", "LightwireExchangeDominatesStep", "LightwireAuthFailures",
        "LightwireResultMismatch", "LightwirePeerCertificateExpiring", "LightwireListenerLimits"}
    _, anchors = doc_anchors()
    for r in rules:
        assert r["labels"]["severity"] in ("critical", "warning", "info"), r["alert"]
        ann = r["annotations"]
        for key in ("summary", "description"):
            assert "{{ $labels.instance }}" in ann[key], (r["alert"], key)
        url = ann["runbook_url"]
        assert url.startswith("docs/metrics.md#"), (r["alert"], url)
        assert url.split("#", 1)[1] in anchors, "%s: runbook anchor %s is not a heading of docs/metrics.md" % (
            r["alert"], url)
    # Every alert has unit tests (promtool test rules runs them: test_check_prometheus_script).
    with open(os.path.join(PROM_DIR, "alerts_test.yml")) as f:
        tests = yaml.safe_load(f)
    tested = {}
    for t in tests["tests"]:
        for a in t.get("alert_rule_test", []):
            tested.setdefault(a["alertname"], set()).add(bool(a.get("exp_alerts")))
    for r in rules:
        assert tested.get(r["alert"]) == {True, False}, (
            "%s needs a promtool test where it fires and one where it does not: %r"
            % (r["alert"], tested.get(r["alert"])))


@pytest.fixture(scope="module")
def promtool():
    if not os.access(PROMTOOL, os.X_OK):
        pytest.skip("%s not found: install Debian's prometheus package (scripts/install-deps.sh)" % PROMTOOL)
    return PROMTOOL


def test_check_prometheus_script(promtool):
    """(d) promtool check config / check rules / test rules, quiet on success."""
    env = dict(os.environ, PROMTOOL=promtool)
    r = subprocess.run([CHECK_SCRIPT], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                       timeout=60)
    out = r.stdout.decode("utf-8", "replace")
    assert r.returncode == 0, "scripts/check-prometheus.sh exited %d:\n%s" % (r.returncode, out)
    assert out == "", "scripts/check-prometheus.sh is not quiet on success:\n%s" % out


# ------------------------------------------------------------------------------------------------
# The live job and Prometheus
# ------------------------------------------------------------------------------------------------
class Prometheus(object):
    """/usr/bin/prometheus on loopback scraping `targets` every second, the repo's alert rules
    loaded, its TSDB in `tmpdir`."""

    def __init__(self, tmpdir, targets):
        self.dir = str(tmpdir)
        self.port = free_tcp_port()
        self.url = "http://127.0.0.1:%d" % self.port
        self.config = os.path.join(self.dir, "prometheus.yml")
        cfg = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": [ALERTS],
            "scrape_configs": [{"job_name": JOB, "static_configs": [{"targets": targets}]}],
        }
        with open(self.config, "w") as f:
            yaml.safe_dump(cfg, f)
        self.log_path = os.path.join(self.dir, "prometheus.log")
        self.proc = None

    def start(self, timeout=30.0):
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [PROMETHEUS, "--config.file=" + self.config,
             "--storage.tsdb.path=" + os.path.join(self.dir, "tsdb"),
             "--web.listen-address=127.0.0.1:%d" % self.port],
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=self._log)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                pytest.fail("prometheus exited with %d; log:\n%s" % (self.proc.returncode, self.log()))
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=1.0) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                pytest.fail("prometheus not ready within %.0f s; log:\n%s" % (timeout, self.log()))
            time.sleep(0.1)

    def stop(self):
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        self._log.close()

    def log(self):
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode("utf-8", "replace")[-6000:]
        except OSError:
            return ""

    def api(self, path, **params):
        """GET /api/v1/<path>: (ok, data or error text)."""
        url = "%s/api/v1/%s?%s" % (self.url, path, urllib.parse.urlencode(params, doseq=True))
        try:
            with urllib.request.urlopen(url, timeout=10.0) as r:
                doc = json.loads(r.read().decode("utf-8"))
        except urllib.error.HTTPError as e:
            try:
                doc = json.loads(e.read().decode("utf-8"))
            except ValueError:
                return False, "HTTP %d" % e.code
        if doc.get("status") != "success":
            return False, "%s: %s" % (doc.get("errorType"), doc.get("error"))
        return True, doc["data"]

    def query(self, expr, at=None):
        params = {"query": expr}
        if at is not None:
            params["time"] = "%.3f" % at
        return self.api("query", **params)

    def value(self, expr):
        ok, data = self.query(expr)
        if not ok or not data["result"]:
            return None
        return float(data["result"][0]["value"][1])


@pytest.fixture
def prometheus_factory(tmp_path_factory):
    if not os.access(PROMETHEUS, os.X_OK):
        pytest.skip("%s not found: install Debian's prometheus package (scripts/install-deps.sh)" % PROMETHEUS)
    made = []

    def make(targets):
        p = Prometheus(tmp_path_factory.mktemp("prom"), targets)
        made.append(p)
        return p.start()

    yield make
    for p in made:
        p.stop()


def http_get(url, timeout=5.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode("utf-8")


def exposed_names(text):
    """Every sample name of a Prometheus text exposition (histograms: _bucket, _sum, _count)."""
    names = set()
    for line in text.splitlines():
        if line and not line.startswith("#"):
            names.add(re.match(r"[A-Za-z_:][A-Za-z0-9_:]*", line).group(0))
    return names


def exposed_families(text):
    return dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))


def has_data(data):
    """A query result with at least one finite or infinite (not NaN) value."""
    res = data["result"]
    if data["resultType"] == "vector":
        return any(not math.isnan(float(s["value"][1])) for s in res)
    if data["resultType"] == "matrix":
        return any(not math.isnan(float(v[1])) for s in res for v in s["values"])
    if data["resultType"] == "scalar":
        return not math.isnan(float(res[1]))
    return bool(res)


def train(cl, steps=STEPS, pause=STEP_PAUSE, nan_step=NAN_STEP):
    """One trainer per rank (raw-body emit_gradient), both tensors every step, a loss and reward
    report after each step; rank 1's weight gradient holds a NaN at `nan_step`. Returns the modes seen."""
    world = len(cl)
    clients = [cl[r].client(timeout=(2.0, 20.0)) for r in range(world)]
    errors, modes = [], []

    def one(r, step):
        c = clients[r]
        try:
            for name, n in TENSORS.items():
                x = np.random.default_rng([r, step, n]).standard_normal(n).astype(np.float32)
                if step == nan_step and r == 1 and name == "layer.0.weight":
                    x[7] = np.nan
                c.emit_gradient(x, name=name, step=step)
                if r == 0 and name == "layer.0.weight":
                    modes.append(c.last_figures.get("mode"))
            c.report(step, loss=1.0 / (1 + step), reward=0.5 * step)  # improving: no rollback
        except Exception as e:  # noqa: BLE001 - reported below with the sidecars' stderr
            errors.append("rank %d step %d: %r" % (r, step, e))

    try:
        for step in range(steps):
            threads = [threading.Thread(target=one, args=(r, step)) for r in range(world)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60.0)
            assert not errors, "%s\n%s" % ("\n".join(errors), cl.stderr())
            time.sleep(pause)
    finally:
        for c in clients:
            c.close()
    return modes


def wait_until(what, cond, timeout, diag=lambda: ""):
    return poll_until(what, cond, timeout, every=0.2, diag=diag)


def test_dashboard_and_alerts_against_prometheus(cluster_factory, prometheus_factory, promtool,
                                                 tmp_path):
    t_start = time.time()
    cl = cluster_factory(2, codec="dgc", codec_args=["--density", "0.1"],
                         extra=["--full-sync-every", "5", "--bypass-steps", "3"], start=False)
    # Over mutual TLS, as production links across a network should be: its metrics too.
    for r, flags in enumerate(tls_flags(tmp_path, len(cl))):
        cl[r].extra = flags
    cl.start()
    ports = [cl[r].admin_port() for r in range(len(cl))]
    targets = ["127.0.0.1:%d" % p for p in ports]
    prom = prometheus_factory(targets)

    def prom_diag():
        return "\n--- prometheus log:\n%s\n--- sidecars:\n%s" % (prom.log(), cl.stderr())

    wait_until("both sidecars scraped (up == 1)",
               lambda: prom.value('count(up{job="%s"} == 1)' % JOB) == len(targets), 20, prom_diag)

    t_train = time.time()
    modes = train(cl)
    assert "full_sync" in modes and "bypass" in modes and "compressed" in modes, modes

    # Prometheus holds the final counters once a scrape after the last step landed.
    texts = [http_get("http://%s/metrics" % t) for t in targets]
    raw = sum(metric_total(t, "lightwire_raw_bytes_total") for t in texts)
    assert raw > 0
    wait_until("the last counters scraped",
               lambda: prom.value('sum(lightwire_raw_bytes_total{job="%s"})' % JOB) == raw, 20, prom_diag)
    now = time.time()
    # Grafana's $__rate_interval and friends: a window covering the whole run.
    window = "%ds" % (int(now - t_train) + 5)

    exposed = set()
    for t in texts:
        exposed |= exposed_names(t)
    families = {}
    for t in texts:
        families.update(exposed_families(t))

    problems = []

    def check_expr(what, expr, need_data):
        q = substitute(expr, window)
        unknown = sorted(n for n in promql_metric_names(q) if n not in exposed and n not in SYNTHETIC)
        if unknown:
            problems.append("%s: names metrics the sidecars do not expose: %s\n    %s" % (what, unknown, q))
        if not promql_metric_names(q):
            problems.append("%s: selects no metric at all\n    %s" % (what, q))
        ok, data = prom.query(q, at=now)
        if not ok:
            problems.append("%s: query failed: %s\n    %s" % (what, data, q))
        elif need_data and not has_data(data):
            problems.append("%s: no data while the job ran: %s\n    %s" % (what, data["result"], q))

    # (a) Every panel query returns data; annotations evaluate (those of events this run had,
    # full-syncs and the NaN anomaly, return some).
    dash = load_dashboard()
    for title, ref, expr in panel_targets(dash):
        check_expr("panel %r query %s" % (title, ref), expr, need_data=True)
    for name, expr in annotation_queries(dash):
        check_expr("annotation %r" % name, expr, need_data=name in ("Full-syncs", "Anomalies"))
    # Template variables: label_values(lightwire_steps_total, job) and the instances of the job.
    ok, jobs = prom.api("label/job/values", **{"match[]": "lightwire_steps_total"})
    assert ok and jobs == [JOB], jobs
    ok, insts = prom.api("label/instance/values", **{"match[]": 'lightwire_steps_total{job=~"%s"}' % JOB})
    assert ok and sorted(insts) == sorted(targets), insts

    # (b) Every alert rule evaluates and names only exposed metrics; Prometheus loaded them all
    # and evaluates them without error.
    rules = alert_rules()
    for r in rules:
        check_expr("alert %s" % r["alert"], r["expr"], need_data=False)

    def loaded():
        ok, data = prom.api("rules", type="alert")
        if not ok:
            return None
        got = [x for g in data["groups"] for x in g["rules"]]
        if len(got) != len(rules) or any(x.get("lastEvaluation", "0001").startswith("0001") for x in got):
            return None  # not loaded, or not evaluated yet
        return got

    got = wait_until("every alert rule evaluated", loaded, 20, prom_diag)
    assert sorted(x["name"] for x in got) == sorted(r["alert"] for r in rules)
    for x in got:
        if x["health"] != "ok":
            problems.append("alert %s: health %s: %s" % (x["name"], x["health"], x.get("lastError")))
    # A healthy job raises none of them.
    firing = [(x["name"], a["labels"], a["state"]) for x in got for a in x.get("alerts", [])]
    if firing:
        problems.append("alerts active on a healthy job: %r" % firing)

    assert not problems, "\n".join(problems) + prom_diag()

    # (c) promtool check metrics on each sidecar's /metrics: no error, no lint warning.
    for target, text in zip(targets, texts):
        r = subprocess.run([promtool, "check", "metrics"], input=text.encode(), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, timeout=30)
        out = r.stdout.decode("utf-8", "replace").strip()
        assert r.returncode == 0 and not out, (
            "promtool check metrics on %s/metrics exited %d:\n%s" % (target, r.returncode, out))

    # docs/metrics.md documents every family a sidecar exposes, and the sidecars expose every
    # family of its catalog (but those it lists as not exported yet).
    doc, anchors = doc_anchors()
    missing = sorted(f for f in families if f not in anchors)
    assert not missing, "families exposed but not documented (as a heading) in docs/metrics.md: %s" % missing
    catalog = set(re.findall(r"^\| \[`([a-z_]+)`\]", doc, re.M))
    later = set(re.findall(r"^### ([a-z_]+)$", doc.split("## Not exported yet", 1)[1].split("\n## ", 1)[0], re.M))
    assert later == {"lightwire_gpu_memory_bytes"}, later
    absent = sorted(catalog - later - set(families))
    assert not absent, "families in docs/metrics.md's catalog that the sidecars do not expose: %s" % absent
    assert time.time() - t_start < 90, "the observability test took %.0f s" % (time.time() - t_start)
