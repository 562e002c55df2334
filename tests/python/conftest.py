"""Fixtures: the real sidecar (skipped when its binary is missing) and the import path."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
CLIENT_DIR = os.path.join(REPO, "clients", "python")
if CLIENT_DIR not in sys.path:
    sys.path.insert(0, CLIENT_DIR)  # also reaches torch.multiprocessing children (spawn)

LIGHTWIRE_BIN = os.environ.get("LIGHTWIRE_BIN") or os.path.join(REPO, "build-release", "proxy", "lightwire")

_serve_ok = None


def _serve_available():
    """(ok, reason): the binary exists and has the `serve` subcommand."""
    global _serve_ok
    if _serve_ok is None:
        if not os.access(LIGHTWIRE_BIN, os.X_OK):
            _serve_ok = (False, "sidecar binary not found at %s (build it or set LIGHTWIRE_BIN)" % LIGHTWIRE_BIN)
        else:
            try:
                r = subprocess.run([LIGHTWIRE_BIN, "serve", "--help"], stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, timeout=20)
                ok = r.returncode == 0 and b"--socket" in r.stdout and b"--local-trainers" in r.stdout
                _serve_ok = (ok, "%s has no `serve` subcommand with --socket/--local-trainers yet "
                                 "(serve --help exited %d)" % (LIGHTWIRE_BIN, r.returncode))
            except (OSError, subprocess.TimeoutExpired) as e:
                _serve_ok = (False, "%s serve --help failed: %s" % (LIGHTWIRE_BIN, e))
    return _serve_ok


class Sidecar(object):
    """A `lightwire serve` process on a Unix socket in a temp dir."""

    def __init__(self, tmpdir, local_trainers=1, codec="none", density=0.01, config=None, extra=(),
                 control_tcp=""):
        self.dir = str(tmpdir)
        self.socket = os.path.join(self.dir, "lightwire.sock")
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
        return a + self.extra

    def start(self, timeout=20.0):
        assert self.proc is None
        self.starts += 1
        self.stderr_path = os.path.join(self.dir, "sidecar-%d.stderr" % self.starts)
        self._stderr = open(self.stderr_path, "wb")
        self.proc = subprocess.Popen(self.args(), stdin=subprocess.DEVNULL, stdout=self._stderr,
                                     stderr=self._stderr)
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
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
            self._stderr.close()

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
