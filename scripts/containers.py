#!/usr/bin/env python3
"""A real Docker engine of our own, the Debian 12 base image, and lightwire's images built on it
(docs/deploy.md "Built and run for real").

    sudo $PYTHON scripts/containers.py images [--variant prebuilt|cpu] [--root DIR]

starts `dockerd` with its own data root, exec root, socket and pid file under DIR (default
build-image-cache/docker: its layers are kept between runs, so a rerun rebuilds only what
changed), with no bridge and no iptables rules (containers use the host's network, or a network
namespace of the caller's), makes the base image `debian:12` from `debootstrap --variant=minbase
bookworm` (cached as a tarball in build-image-cache/, shared with scripts/check-image.py) when the
engine does not have it, builds the images of docker/Dockerfile (`lightwire:0.1` and
`lightwire-trainer:0.1`) and docker/prometheus/Dockerfile (`lightwire-prometheus:0.1`) with
BuildKit, and stops the engine by its pid. `--variant prebuilt` (default) puts this tree's
release binary (build-release/proxy/lightwire, built first) into the sidecar image; `cpu` builds
it inside the image without CUDA. The test (tests/python/test_containers.py) and the scenario
(scripts/container-scenario.sh) use the Engine class.

Needs root and the `docker.io` package (scripts/install-deps.sh installs it); reaches Debian's
mirror (debootstrap, and apt-get inside the builds, with the host's network).
"""

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
CACHE = os.path.join(REPO, "build-image-cache")
MIRROR = "http://deb.debian.org/debian"
# Debian's client (engine 20.10); a newer static client may come first on PATH.
DOCKER = "/usr/bin/docker"
DOCKERD = "/usr/sbin/dockerd"
IMAGES = {"sidecar": "lightwire:0.1", "trainer": "lightwire-trainer:0.1",
          "prometheus": "lightwire-prometheus:0.1"}


def note(msg):
    print("containers: " + msg, file=sys.stderr, flush=True)


class EngineError(RuntimeError):
    pass


def available():
    """(True, "") when a real engine can run here, else (False, why)."""
    if os.geteuid() != 0:
        return False, "needs root (dockerd)"
    for path, package in ((DOCKERD, "docker.io"), (DOCKER, "docker.io")):
        if not os.path.exists(path):
            return False, "%s not found: the %s package is not installed " \
                          "(scripts/install-deps.sh installs it)" % (path, package)
    return True, ""


class Engine(object):
    """`dockerd` with its own data root, exec root, socket and pid file under `root`; no bridge,
    no iptables rules: containers take the host's network (or the caller's namespace)."""

    def __init__(self, root):
        self.root = os.path.abspath(root)
        self.data = os.path.join(self.root, "data")
        # The exec root holds the containers' runtime state (and a socket path must stay short).
        self.exec_root = tempfile.mkdtemp(prefix="lw-dexec-")
        self.socket = os.path.join(self.exec_root, "docker.sock")
        self.pidfile = os.path.join(self.exec_root, "docker.pid")
        self.log_path = os.path.join(self.root, "dockerd.log")
        self.proc = None
        self.env = dict(os.environ, DOCKER_HOST="unix://" + self.socket, DOCKER_BUILDKIT="1")
        self.env.pop("DOCKER_CONTEXT", None)

    def start(self, timeout=90):
        os.makedirs(self.data, exist_ok=True)
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [DOCKERD, "--data-root", self.data, "--exec-root", self.exec_root,
             "-H", "unix://" + self.socket, "--pidfile", self.pidfile, "--bridge=none",
             "--iptables=false", "--ip6tables=false", "--ip-masq=false",
             "--userland-proxy=false", "--storage-driver=overlay2"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise EngineError("dockerd exited with %d: %s" % (self.proc.returncode,
                                                                  self.log_tail()))
            r = subprocess.run([DOCKER, "version", "--format", "{{.Server.Version}}"],
                               env=self.env, capture_output=True, text=True)
            if r.returncode == 0:
                note("dockerd %s up (data root %s, pid %d)" % (r.stdout.strip(), self.data,
                                                              self.proc.pid))
                return self
            time.sleep(0.5)
        self.stop()
        raise EngineError("dockerd did not answer within %d s: %s" % (timeout, self.log_tail()))

    def log_tail(self, lines=15):
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    def docker(self, *args, check=True, timeout=None, capture=True, env=None):
        r = subprocess.run([DOCKER] + list(args), env=dict(self.env, **(env or {})),
                           capture_output=capture, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise EngineError("docker %s: exit %d: %s" % (
                " ".join(args[:3]), r.returncode, ((r.stderr or "") + (r.stdout or ""))[-3000:]))
        return r

    def compose(self, files, *args, env=None, check=True, timeout=None):
        argv = ["docker-compose"]
        for f in files:
            argv += ["-f", f]
        r = subprocess.run(argv + list(args), env=dict(self.env, **(env or {})),
                           capture_output=True, text=True, timeout=timeout, cwd=REPO)
        if check and r.returncode != 0:
            raise EngineError("docker-compose %s: exit %d: %s" % (
                " ".join(args[:2]), r.returncode, (r.stderr + r.stdout)[-3000:]))
        return r

    def stop(self, timeout=30):
        """Stops every container, then dockerd by its pid; unmounts what it left."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            ids = self.docker("ps", "-q", check=False).stdout.split()
            if ids:
                self.docker("kill", *ids, check=False)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        # Mounts under the roots that a killed daemon could leave.
        with open("/proc/self/mounts") as f:
            points = [line.split()[1] for line in f]
        for p in sorted(points, key=len, reverse=True):
            if p.startswith(self.data + "/") or p.startswith(self.exec_root + "/"):
                subprocess.run(["umount", "-l", p], stderr=subprocess.DEVNULL)
        shutil.rmtree(self.exec_root, ignore_errors=True)
        self.proc = None
        note("dockerd stopped")

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def base_tarball(cache=CACHE):
    """The cached tarball of a fresh `debootstrap --variant=minbase bookworm` tree."""
    os.makedirs(cache, exist_ok=True)
    tarball = os.path.join(cache, "bookworm-minbase.tar")
    if os.path.exists(tarball):
        return tarball
    if shutil.which("debootstrap") is None:
        raise EngineError("debootstrap not found (scripts/install-deps.sh installs it)")
    work = tempfile.mkdtemp(prefix="lw-rootfs-", dir=cache)
    try:
        note("debootstrap --variant=minbase bookworm (once; cached in %s) ..." % tarball)
        t0 = time.monotonic()
        r = subprocess.run(["debootstrap", "--variant=minbase", "bookworm", work + "/root",
                            MIRROR], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if r.returncode != 0:
            raise EngineError("debootstrap: " + r.stdout[-2000:])
        subprocess.run(["tar", "-C", work + "/root", "-cf", tarball + ".tmp", "."], check=True)
        os.replace(tarball + ".tmp", tarball)
        note("debootstrap done (%.0f s)" % (time.monotonic() - t0))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return tarball


def base_image(engine, cache=CACHE, tag="debian:12"):
    """`debian:12` in the engine: the minbase tree imported (no registry is reachable here; real
    users pull the official image)."""
    if engine.docker("image", "inspect", tag, check=False).returncode == 0:
        return tag
    tarball = base_tarball(cache)
    with open(tarball, "rb") as f:
        r = subprocess.run([DOCKER, "import", "-", tag], stdin=f, env=engine.env,
                           capture_output=True, text=True)
    if r.returncode != 0:
        raise EngineError("docker import: " + r.stderr[-2000:])
    note("imported %s from %s" % (tag, tarball))
    return tag


def build(engine, target, tag, variant="prebuilt", dockerfile="docker/Dockerfile"):
    """docker build (BuildKit, the host's network for apt-get) of one stage."""
    t0 = time.monotonic()
    args = ["build", "--network", "host", "-f", dockerfile, "-t", tag,
            "--build-arg", "LW_BINARY=%s" % {"cpu": "build-cpu"}.get(variant, variant),
            "--progress", "plain"]
    if target:
        args += ["--target", target]
    r = subprocess.run([DOCKER] + args + [REPO], env=engine.env, capture_output=True, text=True)
    if r.returncode != 0:
        raise EngineError("docker build %s: exit %d:\n%s" % (tag, r.returncode,
                                                              (r.stderr + r.stdout)[-4000:]))
    note("built %s (%s, %.0f s)" % (tag, target or dockerfile, time.monotonic() - t0))
    return tag


def build_images(engine, variant="prebuilt"):
    """The sidecar, trainer and Prometheus images on the base image."""
    if variant == "prebuilt":
        binary = os.path.join(REPO, "build-release", "proxy", "lightwire")
        if not os.access(binary, os.X_OK):
            raise EngineError("%s not found: build it first (bash scripts/build.sh release "
                              "build-release)" % binary)
    base_image(engine)
    build(engine, "sidecar", IMAGES["sidecar"], variant)
    build(engine, "trainer", IMAGES["trainer"], variant)
    build(engine, None, IMAGES["prometheus"], variant, dockerfile="docker/prometheus/Dockerfile")
    return IMAGES


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["images"])
    ap.add_argument("--variant", choices=["prebuilt", "cpu"], default="prebuilt")
    ap.add_argument("--root", default=os.path.join(CACHE, "docker"))
    args = ap.parse_args(argv)
    ok, why = available()
    if not ok:
        note(why)
        return 2
    with Engine(args.root) as engine:
        for name, tag in build_images(engine, args.variant).items():
            size = engine.docker("image", "inspect", "-f", "{{.Size}}", tag).stdout.strip()
            print("%-10s %-28s %6.0f MB" % (name, tag, int(size) / 1e6))
    return 0


if __name__ == "__main__":
    sys.exit(main())
