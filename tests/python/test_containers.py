"""The images and the compose stack on a real Docker engine (docs/deploy.md "Built and run for
real"): a `dockerd` of the test's own (own data root, exec root, socket; no bridge, no iptables;
stopped by its pid), the base image made with debootstrap, the images of docker/Dockerfile
(sidecar from this tree's release binary: `prebuilt`; trainer) and docker/prometheus/Dockerfile
built with BuildKit, then docker/compose.yml with docker/compose.test.yml: two nodes of trainer +
sidecar and a Prometheus. The training runs to the end with compression, the engine's health
checks turn `healthy`, Prometheus's targets are up and it answers a query of the trainers'
steps, the sidecars run as the image's unprivileged user; and while the trainers train, the
failures: a sidecar killed by its host pid (its trainer falls back, the restart policy brings it
back, compressed steps resume) and `docker stop` / `docker start` (the SIGTERM checkpoint on the
volume, resumed from it).

LW_CONTAINER_SCENARIO=full (scripts/container-scenario.sh) builds the sidecar image from source
inside the engine (`LW_BINARY=build-cpu`) instead of taking this tree's release binary, and
trains longer.

Skips without root or without the docker.io package; a daemon that fails to start where both
exist is a failure."""

import json
import os
import re
import resource
import shutil
import signal
import socket
import sys
import tempfile
import time
import urllib.parse
import urllib.request

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "scripts"))
import containers  # noqa: E402
from conftest import metric_total as metric, poll_until  # noqa: E402

FULL = os.environ.get("LW_CONTAINER_SCENARIO") == "full"
# The trainers' steps in the test command, each at least MIN_STEP_SECONDS long: 32 s of training
# at the least, however fast the machine; the failure scenario's waits take about 19 s of it.
STEPS = 4000
MIN_STEP_SECONDS = 0.008
FILES = [os.path.join(REPO, "docker", "compose.yml"),
         os.path.join(REPO, "docker", "compose.test.yml")]


def free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


_T0 = time.monotonic()


def wait_until(what, pred, timeout, every=1.0):
    """poll_until, and when it was met (seconds since the module loaded: in the test's output)."""
    got = poll_until(what, pred, timeout, every=every)
    print("%7.1f s  %s" % (time.monotonic() - _T0, what))
    return got


def http_json(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read().decode())


@pytest.fixture(scope="module")
def engine():
    ok, why = containers.available()
    if not ok:
        pytest.skip(why)
    e = containers.Engine(os.path.join(containers.CACHE, "docker"))
    e.start()  # an engine that cannot start here is a failure, not a skip
    try:
        containers.build_images(e, "cpu" if FULL else "prebuilt")
        yield e
    finally:
        e.stop()


class Stack(object):
    """The compose stack of one test: its project name, ports and environment."""

    def __init__(self, engine, steps, min_step_seconds):
        self.engine = engine
        self.project = "lwtest%d" % os.getpid()
        (self.peer0, self.peer1, self.admin0, self.admin1, self.master,
         self.prom) = free_ports(6)
        self.conf = tempfile.mkdtemp(prefix="lw-prom-")
        shutil.copy(os.path.join(REPO, "docker", "prometheus", "alerts.yml"), self.conf)
        with open(os.path.join(self.conf, "prometheus.yml"), "w") as f:
            f.write("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                    "rule_files: [alerts.yml]\n"
                    "scrape_configs:\n  - job_name: lightwire\n    static_configs:\n"
                    "      - targets: ['127.0.0.1:%d', '127.0.0.1:%d']\n" % (self.admin0,
                                                                            self.admin1))
        os.chmod(self.conf, 0o755)
        for name in os.listdir(self.conf):
            os.chmod(os.path.join(self.conf, name), 0o644)
        # The job secret as a file only the sidecars' user reads (as the pods mount it).
        self.secret = "container-test-%d-%s" % (os.getpid(), os.urandom(8).hex())
        self.secret_file = os.path.join(self.conf, "peer-secret")
        with open(self.secret_file, "w") as f:
            f.write(self.secret)
        os.chown(self.secret_file, 10001, 10001)
        os.chmod(self.secret_file, 0o400)
        self.env = {
            # docker/compose.yml wants it set; the test override reads the secret from the file.
            "LIGHTWIRE_SECRET": "unused",
            "LW_SECRET_FILE": self.secret_file,
            "LIGHTWIRE_DEMO_STEPS": str(steps),
            "LW_MIN_STEP_SECONDS": str(min_step_seconds),
            "LW_PEER_PORT_0": str(self.peer0), "LW_PEER_PORT_1": str(self.peer1),
            "LW_ADMIN_PORT_0": str(self.admin0), "LW_ADMIN_PORT_1": str(self.admin1),
            "LW_MASTER_PORT": str(self.master), "LW_PROMETHEUS_PORT": str(self.prom),
            "LW_PROMETHEUS_CONFIG": self.conf,
            # The compose file asks for 65536 open files; a container cannot exceed the hard
            # limit the engine has.
            "LW_NOFILE": str(min(65536, resource.getrlimit(resource.RLIMIT_NOFILE)[1])),
        }

    def compose(self, *args, check=True, timeout=300):
        return self.engine.compose(FILES, "-p", self.project, *args, env=self.env, check=check,
                                   timeout=timeout)

    def container(self, service):
        return "%s_%s_1" % (self.project, service)

    def inspect(self, service, fmt):
        return self.engine.docker("inspect", "-f", fmt, self.container(service)).stdout.strip()

    def metrics(self, rank):
        port = self.admin0 if rank == 0 else self.admin1
        with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=5) as r:
            return r.read().decode()

    def logs(self, service):
        r = self.engine.docker("logs", self.container(service), check=False)
        return r.stdout + r.stderr

    def down(self):
        self.compose("down", "-v", "--remove-orphans", check=False)
        shutil.rmtree(self.conf, ignore_errors=True)


@pytest.fixture
def stack(engine):
    made = []

    def make(steps, min_step_seconds=0.0):
        s = Stack(engine, steps, min_step_seconds)
        made.append(s)
        return s

    yield make
    for s in made:
        for service in ("lightwire-0", "lightwire-1", "trainer-0", "trainer-1"):
            print("---- %s\n%s" % (service, s.logs(service)[-2500:]))
        s.down()


def test_images_are_built_and_the_sidecar_runs_unprivileged(engine):
    out = engine.docker("run", "--rm", "--network", "host", "--entrypoint", "/bin/sh",
                        containers.IMAGES["sidecar"], "-c",
                        "id -u; id -g; lightwire --version").stdout.split("\n")
    assert out[0] == "10001" and out[1] == "10001", out
    assert out[2].startswith("lightwire"), out
    cfg = json.loads(engine.docker("image", "inspect", containers.IMAGES["sidecar"]).stdout)[0]
    assert cfg["Config"]["User"] == "10001:10001"
    assert cfg["Config"]["Healthcheck"]["Test"][:2] == ["CMD", "lightwire"]
    assert cfg["Config"]["Entrypoint"] == ["lightwire"]
    trainer = json.loads(engine.docker("image", "inspect", containers.IMAGES["trainer"]).stdout)
    assert trainer[0]["Config"]["User"] == "10001:10001"


def test_compose_stack_trains_and_prometheus_sees_it(stack):
    # The failures happen while the trainers train.
    s = stack(steps=12000 if FULL else STEPS, min_step_seconds=0 if FULL else MIN_STEP_SECONDS)
    s.compose("up", "-d", "--no-build")
    for service in ("lightwire-0", "lightwire-1"):
        wait_until("%s healthy" % service,
                   lambda: s.inspect(service, "{{.State.Health.Status}}") == "healthy", 120)
        # The sidecar process runs as the image's user, on a read-only root file system, with the
        # job secret from its file and nowhere in its environment (the peers connected: the two
        # files agree).
        pid = int(s.inspect(service, "{{.State.Pid}}"))
        with open("/proc/%d/status" % pid) as f:
            uid = re.search(r"^Uid:\s+(\d+)", f.read(), re.M).group(1)
        assert uid == "10001"
        assert s.inspect(service, "{{.HostConfig.ReadonlyRootfs}}") == "true"
        with open("/proc/%d/environ" % pid, "rb") as f:
            environ = f.read()
        assert s.secret.encode() not in environ
        assert b"LIGHTWIRE_PEER__SECRET_FILE=/run/secrets/lightwire/peer-secret" in environ
        r = s.engine.docker("exec", s.container(service), "/bin/sh", "-c",
                            "touch /usr/local/bin/x 2>&1; echo $?", check=False)
        assert "Read-only file system" in r.stdout, r.stdout
    crash_and_restart(s)
    stop_and_start(s)
    # Training runs to the end, with compression, on both nodes.
    for service in ("trainer-0", "trainer-1"):
        wait_until("%s to exit" % service,
                   lambda: s.inspect(service, "{{.State.Status}}") == "exited", 900, every=2)
        assert s.inspect(service, "{{.State.ExitCode}}") == "0", s.logs(service)[-3000:]
    log0 = s.logs("trainer-0")
    assert "final loss" in log0 and "compression" in log0, log0[-3000:]
    # The trainers fell back to DDP's own allreduce while a sidecar was away (the hook says so),
    # and went on; rank 0's summary counts its fallbacks.
    for service in ("trainer-0", "trainer-1"):
        assert "falls back to the process group's allreduce" in s.logs(service)
    final = re.search(r"final loss .* (\d+) fallbacks", log0)
    assert final and int(final.group(1)) > 0, log0[-3000:]
    ok_steps = [metric(s.metrics(r), "lightwire_steps_total", 'result="ok"') for r in (0, 1)]
    assert min(ok_steps) > 0, ok_steps
    # Prometheus (Debian's, in its own container) scrapes both sidecars and answers a query.
    base = "http://127.0.0.1:%d" % s.prom
    targets = wait_until("Prometheus's targets up", lambda: (
        lambda t: t if len(t) == 2 and all(x["health"] == "up" for x in t) else None)(
            http_json(base + "/api/v1/targets")["data"]["activeTargets"]), 60)
    assert sorted(t["scrapeUrl"] for t in targets) == sorted(
        "http://127.0.0.1:%d/metrics" % p for p in (s.admin0, s.admin1))
    q = urllib.parse.quote('sum(lightwire_steps_total{result="ok"})')

    def answered():
        r = http_json(base + "/api/v1/query?query=" + q)["data"]["result"]
        return r and float(r[0]["value"][1]) >= sum(ok_steps) * 0.5 and r
    result = wait_until("Prometheus to see the trainers' steps", answered, 60)
    assert float(result[0]["value"][1]) > 0
    rules = http_json(base + "/api/v1/rules")["data"]["groups"]
    assert rules, "the repository's alert rules are loaded"


def crash_and_restart(s):
    """Kills sidecar 1 by its host pid mid-training: its trainer falls back, the restart policy
    brings the sidecar back, compressed steps resume."""
    wait_until("compressed steps on rank 1",
               lambda: metric(s.metrics(1), "lightwire_steps_total", 'result="ok"') >= 300, 300)
    pid = int(s.inspect("lightwire-1", "{{.State.Pid}}"))
    os.kill(pid, signal.SIGKILL)
    wait_until("lightwire-1 restarted", lambda: int(s.inspect(
        "lightwire-1", "{{.RestartCount}}")) >= 1 and s.inspect(
        "lightwire-1", "{{.State.Health.Status}}") == "healthy", 180)

    def resumed():
        try:
            return metric(s.metrics(1), "lightwire_steps_total", 'result="ok"') >= 10
        except OSError:
            return False
    wait_until("compressed steps after the restart", resumed, 300)
    assert s.inspect("trainer-1", "{{.State.Status}}") == "running", "the trainer outlived it"


def stop_and_start(s):
    """`docker stop` writes the SIGTERM checkpoint to the volume; `docker start` resumes from it."""
    s.engine.docker("stop", "-t", "30", s.container("lightwire-0"))
    assert s.inspect("lightwire-0", "{{.State.ExitCode}}") == "0"
    saved = re.findall(r"checkpoint of step (\d+) \(sigterm\): \d+ tensor\(s\) written to "
                       r"(/var/lib/lightwire/\S+)", s.logs("lightwire-0"))
    assert saved, s.logs("lightwire-0")[-3000:]
    s.engine.docker("start", s.container("lightwire-0"))
    wait_until("lightwire-0 healthy again",
               lambda: s.inspect("lightwire-0", "{{.State.Health.Status}}") == "healthy", 120)
    step, path = saved[-1]
    wait_until("lightwire-0 to restore its SIGTERM checkpoint from the volume", lambda: (
        "restored the codec state of step %s from %s" % (step, path)) in s.logs("lightwire-0"),
        60)
    assert s.inspect("trainer-0", "{{.State.Status}}") == "running", "the trainer outlived it"
