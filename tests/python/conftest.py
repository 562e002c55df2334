"""Fixtures: the real sidecar (skipped when its binary is missing) and the import path."""

import multiprocessing
import os
import random
import signal
import socket
import subprocess
import sys
import time

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
CLIENT_DIR = os.path.join(REPO, "clients", "python")
if CLIENT_DIR not in sys.path:
    sys.path.insert(0, CLIENT_DIR)  # also reaches torch.multiprocessing children

# Trainer processes (torch.multiprocessing.start_processes) start from a fork server that imported
# torch once: each saves the CPU-second of importing it again, as "spawn" did. Like spawn's, they
# begin from a fresh interpreter, not from the test's state, but with the environment the server
# started with: what a child needs goes in its arguments, or is set in the child.
START_METHOD = "forkserver"
multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "torch.nn.parallel"])

LIGHTWIRE_BIN = os.environ.get("LIGHTWIRE_BIN") or os.path.join(REPO, "build-release", "proxy", "lightwire")

_serve_ok = None
_serve_help = b""


def _serve_available():
    """(ok, reason): the binary exists and has the `serve` subcommand."""
    global _serve_ok, _serve_help
    if _serve_ok is None:
        if not os.access(LIGHTWIRE_BIN, os.X_OK):
            _serve_ok = (False, "sidecar binary not found at %s (build it or set LIGHTWIRE_BIN)" % LIGHTWIRE_BIN)
        else:
            try:
                r = subprocess.run([LIGHTWIRE_BIN, "serve", "--help"], stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, timeout=20)
                ok = r.returncode == 0 and b"--socket" in r.stdout and b"--local-trainers" in r.stdout
                _serve_help = r.stdout
                _serve_ok = (ok, "%s has no `serve` subcommand with --socket/--local-trainers yet "
                                 "(serve --help exited %d)" % (LIGHTWIRE_BIN, r.returncode))
            except (OSError, subprocess.TimeoutExpired) as e:
                _serve_ok = (False, "%s serve --help failed: %s" % (LIGHTWIRE_BIN, e))
    return _serve_ok


# The sidecars of these tests run without the schedules that `lightwire serve` turns on by
# default (the DGC warm-up, the PowerSGD start step: docs/policies.md "Schedules"): their results
# are compared with the reference codecs at the configured density and rank from the first step.
# The schedules' own tests pass their flags, which win over the environment.
PINNED_SCHEDULES = {"LIGHTWIRE_SCHEDULE__WARMUP_STEPS": "0",
                    "LIGHTWIRE_SCHEDULE__POWERSGD_START_STEP": "0"}


def pinned_schedules(environ):
    """A copy of `environ` with PINNED_SCHEDULES where it does not set them itself."""
    env = dict(environ)
    for k, v in PINNED_SCHEDULES.items():
        env.setdefault(k, v)
    return env


def serve_has_flag(flag):
    """True when `lightwire serve --help` lists `flag` (e.g. "--state-dir")."""
    _serve_available()
    return flag.encode() in _serve_help


class Sidecar(object):
    """A `lightwire serve` process on a Unix socket in a temp dir.

    `state_dir`: its --state-dir (checkpoints), by default `<its temp dir>/state`, so that no test
    touches /var/lib/lightwire or another test's files; None = the flag is not passed. A restart
    (stop()/kill() then start()) keeps it."""

    def __init__(self, tmpdir, local_trainers=1, codec="none", density=0.01, config=None, extra=(),
                 control_tcp="", state_dir="default"):
        self.dir = str(tmpdir)
        self.socket = os.path.join(self.dir, "lightwire.sock")
        self.state_dir = os.path.join(self.dir, "state") if state_dir == "default" else state_dir
        self.local_trainers = local_trainers
        self.codec = codec
        self.density = density
        self.config = config
        self.extra = list(extra)
        self.control_tcp = control_tcp
        self.proc = None
        self.starts = 0

    def args(self):
        a = [LIGHTWIRE_BIN, "serve", "--socket", self.socket, "--control-tcp", self.control_tcp, "--admin-listen", "",
             "--local-trainers", str(self.local_trainers), "--codec", self.codec]
        if self.codec != "none":
            a += ["--density", str(self.density)]
        if self.config:
            a += ["--config", self.config]
        return a + self.state_args() + self.extra

    def state_args(self):
        if self.state_dir is None or not serve_has_flag("--state-dir"):
            return []
        return ["--state-dir", self.state_dir]

    def spawn(self):
        """Starts the process without waiting for it (see start(), wait_exit())."""
        assert self.proc is None
        self.starts += 1
        self.stderr_path = os.path.join(self.dir, "sidecar-%d.stderr" % self.starts)
        self._stderr = open(self.stderr_path, "wb")
        self.proc = subprocess.Popen(self.args(), stdin=subprocess.DEVNULL, stdout=self._stderr,
                                     stderr=self._stderr, env=pinned_schedules(os.environ))
        return self

    def start(self, timeout=20.0):
        self.spawn()
        import lightwire
        probe = lightwire.Client(socket_path=self.socket, timeout=(1.0, 2.0))
        deadline = time.monotonic() + timeout
        try:
            while True:
                if self.proc.poll() is not None:
                    pytest.fail("sidecar exited with %d before it was ready; stderr:\n%s"
                                % (self.proc.returncode, self.stderr()))
                if os.path.exists(self.socket) and probe.healthz():
                    return self
                if time.monotonic() > deadline:
                    self.kill()
                    pytest.fail("sidecar not healthy within %.0f s; stderr:\n%s" % (timeout, self.stderr()))
                time.sleep(0.05)
        finally:
            probe.close()

    def stderr(self):
        try:
            with open(self.stderr_path, "rb") as f:
                return f.read().decode("utf-8", "replace")[-8000:]
        except OSError:
            return ""

    def stop(self, timeout=10.0):
        """SIGTERM; asserts exit status 0 within `timeout` and the socket file removed."""
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            self._stderr.close()
            pytest.fail("sidecar did not exit within %.0f s of SIGTERM; stderr:\n%s" % (timeout, self.stderr()))
        self._stderr.close()
        assert rc == 0, "sidecar exited with %d after SIGTERM; stderr:\n%s" % (rc, self.stderr())
        assert not os.path.exists(self.socket), "sidecar left its socket %s behind" % self.socket

    def kill(self):
        """SIGKILL (kill -9) and reap; no checkpoint, no cleanup (the socket file stays)."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
            self._stderr.close()

    def wait_exit(self, timeout=20.0):
        """For a process expected to exit by itself (e.g. refusing to start): its exit status once
        it exited within `timeout` (else it is killed and the test fails), with its stderr."""
        assert self.proc is not None
        proc, self.proc = self.proc, None
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            self._stderr.close()
            pytest.fail("sidecar still running %.0f s after start, expected it to exit; stderr:\n%s"
                        % (timeout, self.stderr()))
        self._stderr.close()
        return rc, self.stderr()

    def client(self, **kw):
        import lightwire
        kw.setdefault("timeout", (5.0, 10.0))
        return lightwire.Client(socket_path=self.socket, **kw)


@pytest.fixture
def sidecar_factory(tmp_path_factory):
    """make(local_trainers=1, codec="none", ...) -> a started Sidecar; all stopped at the end
    (SIGTERM, exit 0, socket removed)."""
    ok, reason = _serve_available()
    if not ok:
        pytest.skip(reason)
    made = []

    def make(start=True, **kw):
        # A short directory name: AF_UNIX paths are limited to 107 bytes.
        sc = Sidecar(tmp_path_factory.mktemp("lw"), **kw)
        made.append(sc)
        return sc.start() if start else sc

    yield make
    for sc in made:
        if sc.proc is not None:
            sc.stop()


@pytest.fixture(scope="module")
def shared_sidecar(tmp_path_factory):
    """One started sidecar (one local trainer, codec none) shared by a module's tests, for
    stateless round trips; tests that stop, stall or reconfigure it use `sidecar` instead."""
    ok, reason = _serve_available()
    if not ok:
        pytest.skip(reason)
    sc = Sidecar(tmp_path_factory.mktemp("lw")).start()
    yield sc
    if sc.proc is not None:
        sc.stop()


@pytest.fixture
def sidecar(sidecar_factory):
    """One started sidecar: one local trainer, codec none."""
    return sidecar_factory()


def free_unix_path(tmp_path):
    p = os.path.join(str(tmp_path), "s.sock")
    assert len(p) < 100
    return p


# ------------------------------------------------------------------------------------------------
# Several sidecars of one job exchanging over loopback TCP (docs/exchange.md)
# ------------------------------------------------------------------------------------------------
def _ephemeral_range():
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


_port_rng = random.Random()
_ports_given = set()  # never the same port twice in one test session


def free_tcp_port():
    """A loopback TCP port that was free a moment ago, below the kernel's ephemeral range: a
    listener on port 0 elsewhere (the sidecars' admin listeners, a client's connection) is never
    given it meanwhile. (A port found by binding port 0 is an ephemeral one, which the next
    process to bind port 0 may be handed before the sidecar it was meant for listens on it.)"""
    lo = _ephemeral_range()[0]
    first = max(1024, lo - 12000)
    for _ in range(200):
        port = _port_rng.randrange(first, lo)
        if port in _ports_given:
            continue
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.bind(("127.0.0.1", port))
            _ports_given.add(port)
            return port
        except OSError:
            continue
        finally:
            s.close()
    raise RuntimeError("no free loopback port in [%d, %d)" % (first, lo))


def poll_until(what, pred, timeout, every=0.05, diag=lambda: ""):
    """Polls pred() until it returns something true (returned); fails the test after `timeout`
    seconds, naming `what` (and diag(), when it says something)."""
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            more = diag()
            pytest.fail("%s: not within %.0f s%s" % (what, timeout, "\n" + more if more else ""))
        time.sleep(every)


def readyz(client):
    """(status, body text) of GET /readyz; (None, reason) when the sidecar cannot be reached."""
    import lightwire
    try:
        r = client.request("GET", "/readyz")
        return r.status, bytes(r.body).decode("utf-8", "replace")
    except lightwire.SidecarUnavailable as e:
        return None, str(e)
    except lightwire.LightwireError as e:
        return e.status, "%s: %s" % (e.error, e.message)


def metric_total(text, name, labels=""):
    """Sum of every sample of metric `name` in a Prometheus exposition (those whose label set
    contains the text `labels`, e.g. 'result="ok"'; any labels by default)."""
    total = 0.0
    for line in text.splitlines():
        if (line.startswith(name) and (len(line) == len(name) or line[len(name)] in " {")
                and labels in line):
            total += float(line.rsplit(None, 1)[1])
    return total


class PeerSidecar(Sidecar):
    """One rank of a multi-sidecar job (see `Cluster`)."""

    def __init__(self, tmpdir, cluster, rank):
        super().__init__(tmpdir, local_trainers=cluster.local_trainers, codec=cluster.codec)
        # self.state_dir: <its temp dir>/state, the same across restarts of this rank.
        self.cluster = cluster
        self.rank = rank
        self.job_id = cluster.job_id
        self.secret = cluster.secret

    def args(self):
        c = self.cluster
        a = [LIGHTWIRE_BIN, "serve", "--socket", self.socket, "--control-tcp", "",
             "--admin-listen", "127.0.0.1:0", "--local-trainers", str(self.local_trainers),
             "--codec", self.codec, "--rank", str(self.rank), "--world-size", str(c.world_size),
             "--peer-timeout", str(c.peer_timeout), "--job-id", self.job_id,
             "--chunk-elements", str(c.chunk_elements), "--threads", "1", "--log-level", "info"]
        if c.peers_template:
            # One port, one loopback address per rank (127.0.R.1), and peer.peers as a template.
            a += ["--peer-listen", "127.0.%d.1:%d" % (self.rank, c.ports[0]),
                  "--peers", "127.0.{rank}.1:%d" % c.ports[0]]
        else:
            a += ["--peer-listen",
                  "127.0.0.1:%d" % (0 if c.rendezvous and self.rank else c.ports[self.rank])]
        if c.rendezvous:
            a += ["--rendezvous", "127.0.0.1:%d" % c.ports[0]]
        elif not c.peers_template:
            a += ["--peers", ",".join("127.0.0.1:%d" % p for p in c.ports)]
        return a + list(c.codec_args) + self.state_args() + list(c.extra) + list(self.extra)

    def launch(self):
        """Starts the process (no waiting); readiness is checked by the cluster."""
        assert self.proc is None
        self.starts += 1
        self.stderr_path = os.path.join(self.dir, "sidecar-%d.stderr" % self.starts)
        self._stderr = open(self.stderr_path, "wb")
        env = pinned_schedules(os.environ)
        env.pop("LIGHTWIRE_SOCKET", None)
        if self.cluster.secret_file:
            # As a mounted secret: a file of the sidecar's user only, with a trailing newline.
            path = os.path.join(self.dir, "peer-secret")
            with open(path, "w") as f:
                f.write(self.secret + "\n")
            os.chmod(path, 0o600)
            env["LIGHTWIRE_PEER__SECRET_FILE"] = path
        else:
            env["LIGHTWIRE_PEER__SECRET"] = self.secret
        self.proc = subprocess.Popen(self.args(), stdin=subprocess.DEVNULL, stdout=self._stderr,
                                     stderr=self._stderr, env=env)
        return self

    def readyz(self):
        c = self.client(timeout=(1.0, 2.0))
        try:
            return readyz(c)
        finally:
            c.close()

    def metrics_text(self):
        c = self.client(timeout=(1.0, 5.0))
        try:
            return c.metrics()
        finally:
            c.close()

    def admin_port(self):
        c = self.client(timeout=(1.0, 5.0))
        try:
            return int(c.status()["listeners"]["admin_port"])
        finally:
            c.close()


class Cluster(object):
    """`world_size` sidecars of one job on loopback: a free peer port each, one shared random
    secret (env LIGHTWIRE_PEER__SECRET), a Unix socket each, admin listener on 127.0.0.1:0."""

    def __init__(self, tmp_path_factory, world_size, codec="none", codec_args=(), local_trainers=1,
                 chunk_elements=1024, peer_timeout=3, job_id="lw-test-job", extra=(),
                 rendezvous=False, peers_template=False, secret_file=False):
        self.world_size = world_size
        # peers_template: --peers 127.0.{rank}.1:PORT (every rank on its own loopback address);
        # secret_file: the secret in a file (LIGHTWIRE_PEER__SECRET_FILE), not the environment.
        self.peers_template = peers_template
        self.secret_file = secret_file
        # rendezvous: only rank 0's address is configured (--rendezvous); the other ranks listen
        # on OS-chosen ports and register them there.
        self.rendezvous = rendezvous
        self.extra = list(extra)  # more `serve` flags for every rank (e.g. --topology ps)
        self.codec = codec
        self.codec_args = list(codec_args)
        self.local_trainers = local_trainers
        self.chunk_elements = chunk_elements
        self.peer_timeout = peer_timeout
        self.job_id = job_id
        self.secret = os.urandom(16).hex()
        self.ports = [free_tcp_port() for _ in range(world_size)]
        self.sidecars = [PeerSidecar(tmp_path_factory.mktemp("lw"), self, r) for r in range(world_size)]

    def __getitem__(self, rank):
        return self.sidecars[rank]

    def __len__(self):
        return self.world_size

    def stderr(self, ranks=None):
        out = []
        for sc in self.sidecars:
            if ranks is None or sc.rank in ranks:
                out.append("--- rank %d (exit %s):\n%s" % (
                    sc.rank, None if sc.proc is None else sc.proc.poll(), sc.stderr()))
        return "\n".join(out)

    def launch(self, ranks=None, timeout=20.0):
        """Starts the sidecars of `ranks` (default all) and waits until each serves /healthz on
        its socket (not for readiness: see wait_ready)."""
        import lightwire
        chosen = [sc for sc in self.sidecars if ranks is None or sc.rank in ranks]
        for sc in chosen:
            sc.launch()
        deadline = time.monotonic() + timeout
        for sc in chosen:
            probe = lightwire.Client(socket_path=sc.socket, timeout=(1.0, 2.0))
            try:
                while not (os.path.exists(sc.socket) and probe.healthz()):
                    if sc.proc.poll() is not None:
                        pytest.fail("sidecar rank %d exited with %d; stderr:\n%s"
                                    % (sc.rank, sc.proc.returncode, self.stderr()))
                    if time.monotonic() > deadline:
                        pytest.fail("sidecar rank %d not healthy within %.0f s; stderr:\n%s"
                                    % (sc.rank, timeout, self.stderr()))
                    time.sleep(0.02)
            finally:
                probe.close()
        return self

    def wait_ready(self, ranks=None, timeout=20.0):
        """Until /readyz is 200 on every rank in `ranks` (default all); fails with stderr."""
        ranks = list(range(self.world_size)) if ranks is None else list(ranks)
        deadline = time.monotonic() + timeout
        last = {}
        while True:
            pending = []
            for r in ranks:
                sc = self.sidecars[r]
                if sc.proc is None or sc.proc.poll() is not None:
                    pytest.fail("sidecar rank %d is not running (exit %s); stderr:\n%s"
                                % (r, None if sc.proc is None else sc.proc.returncode, self.stderr()))
                st = sc.readyz() if os.path.exists(sc.socket) else (None, "no socket yet")
                last[r] = st
                if st[0] != 200:
                    pending.append(r)
            if not pending:
                return self
            if time.monotonic() > deadline:
                pytest.fail("sidecars %s not ready within %.0f s (last /readyz: %r); stderr:\n%s"
                            % (pending, timeout, last, self.stderr()))
            time.sleep(0.05)

    def start(self, timeout=20.0):
        return self.launch().wait_ready(timeout=timeout)

    def stop(self):
        """SIGTERM every running sidecar; each must exit 0 and remove its socket."""
        errors = []
        for sc in self.sidecars:
            if sc.proc is not None:
                sc.proc.send_signal(signal.SIGTERM)
        for sc in self.sidecars:
            if sc.proc is None:
                continue
            proc, sc.proc = sc.proc, None
            try:
                rc = proc.wait(10.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                rc = "no exit within 10 s of SIGTERM"
            sc._stderr.close()
            if rc != 0:
                errors.append("rank %d: exit %s; stderr:\n%s" % (sc.rank, rc, sc.stderr()))
            elif os.path.exists(sc.socket):
                errors.append("rank %d left its socket %s behind" % (sc.rank, sc.socket))
        assert not errors, "\n".join(errors)

    def kill_all(self):
        for sc in self.sidecars:
            sc.kill()

    def kill9(self, rank):
        """SIGKILL one rank (a crash: no checkpoint on the way out) and reap it."""
        self.sidecars[rank].kill()

    def restart(self, ranks, timeout=20.0, extra=None):
        """Kill -9 the sidecars of `ranks` (an int or a list) where still running, then start them
        again with the same ports, state dirs and flags (`extra`, when given, replaces their own
        extra flags) and wait until every rank is ready."""
        ranks = [ranks] if isinstance(ranks, int) else list(ranks)
        for r in ranks:
            self.sidecars[r].kill()
            if extra is not None:
                self.sidecars[r].extra = list(extra)
        return self.launch(ranks, timeout=timeout).wait_ready(timeout=timeout)


# ------------------------------------------------------------------------------------------------
# A throwaway PKI for peer TLS
# ------------------------------------------------------------------------------------------------
NODE_EXT = """basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = serverAuth, clientAuth
"""

def make_pki(directory, name, nodes, days):
    """A CA and node certificates made with the commands of docs/peer-protocol.md "TLS";
    returns {node: (cert, key)} and the CA file."""
    def run(*args):
        r = subprocess.run(args, cwd=directory, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           timeout=60)
        assert r.returncode == 0, (args, r.stdout.decode())
    ca, ca_key = name + "-ca.pem", name + "-ca.key"
    run("openssl", "req", "-x509", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
        "-nodes", "-keyout", ca_key, "-out", ca, "-days", "365", "-subj", "/CN=%s CA" % name,
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    with open(os.path.join(directory, "node.ext"), "w") as f:
        f.write(NODE_EXT)
    out = {}
    for n in nodes:
        base = "%s-%s" % (name, n)
        run("openssl", "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
            "-keyout", base + ".key", "-out", base + ".csr", "-subj", "/CN=%s %s" % (name, n))
        run("openssl", "x509", "-req", "-in", base + ".csr", "-CA", ca, "-CAkey", ca_key,
            "-CAcreateserial", "-days", str(days), "-extfile", "node.ext", "-out", base + ".pem")
        out[n] = (os.path.join(directory, base + ".pem"), os.path.join(directory, base + ".key"))
    return out, os.path.join(directory, ca)


def tls_flags(directory, world_size, name="job", days=30):
    """`serve` flags of every rank for mutual TLS with a fresh CA made in `directory`."""
    nodes, ca = make_pki(str(directory), name, ["node%d" % r for r in range(world_size)], days)
    return [["--peer-tls", "--peer-tls-cert", nodes["node%d" % r][0], "--peer-tls-key",
             nodes["node%d" % r][1], "--peer-tls-ca", ca] for r in range(world_size)]


@pytest.fixture
def cluster_factory(tmp_path_factory):
    """make(world_size, codec=..., codec_args=[...], local_trainers=1, chunk_elements=1024,
    peer_timeout=3, job_id=..., extra=[...], start=True) -> a Cluster (started and ready unless
    start=False). Each rank gets its own --state-dir (`cluster[r].state_dir`, kept across
    restarts); `extra` flags go to every rank, `cluster[r].extra` to one.
    At the end every cluster is stopped with SIGTERM (exit 0, sockets removed); leftovers are
    always killed."""
    ok, reason = _serve_available()
    if not ok:
        pytest.skip(reason)
    made = []

    def make(world_size, start=True, **kw):
        cl = Cluster(tmp_path_factory, world_size, **kw)
        made.append(cl)
        return cl.start() if start else cl

    try:
        yield make
        for cl in made:
            cl.stop()
    finally:
        for cl in made:
            cl.kill_all()
