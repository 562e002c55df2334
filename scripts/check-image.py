#!/usr/bin/env python3
"""Runs docker/Dockerfile's `sidecar` stage without a container engine, then the sidecar in it.

    sudo $PYTHON scripts/check-image.py [--bin build-release/proxy/lightwire] [--keep DIR]

For machines where no container engine can run (the test command runs it only there; with an
engine, tests/python/test_containers.py builds and runs the images for real), this emulates the
stage on a real Debian 12 root file system: `debootstrap --variant=minbase bookworm` (what the debian:12 image is
made of), then the stage's instructions in order, read from the Dockerfile itself: COPY from the
repository, `COPY --from=build` from this machine's release build (the build stage needs NVIDIA's
repository, which these machines cannot reach), ENV, and every RUN in a chroot (apt-get reaches
Debian's mirror). Then it starts the ENTRYPOINT + CMD as the stage's USER, runs the HEALTHCHECK
command and `lightwire health --ready` inside, checks that `ldd` finds every library, and sends a
gradient through the control socket in the image's socket VOLUME. What this does not cover: the
build stage, the NVIDIA container toolkit, Docker's own handling of the file (docs/deploy.md).

Needs root (debootstrap, chroot, mounts) and network access to deb.debian.org. The fresh root
file system is cached in build-image-cache/ (a tarball) so that reruns skip debootstrap.
Exit status 0 when every check passes; one line per step on stderr.
"""

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
MIRROR = "http://deb.debian.org/debian"


def note(msg):
    print("check-image: " + msg, file=sys.stderr, flush=True)


def fail(msg):
    note("FAILED: " + msg)
    sys.exit(1)


def instructions(dockerfile, stage):
    """(INSTRUCTION, argument text) of one stage, continuations joined, comments dropped."""
    lines, cur = [], ""
    with open(dockerfile, encoding="utf-8") as f:
        for raw in f:
            s = raw.strip()
            if s.startswith("#") or (not s and not cur):
                continue
            if s.endswith("\\"):
                cur += s[:-1] + " "
                continue
            lines.append(cur + s)
            cur = ""
    out, current = [], None
    for line in lines:
        word, _, rest = line.partition(" ")
        word = word.upper()
        if word == "FROM":
            m = re.match(r"\S+\s+AS\s+(\S+)$", rest.strip(), re.I)
            current = m.group(1) if m else None
            continue
        if current == stage:
            out.append((word, rest.strip()))
    if not out:
        fail("no stage %r in %s" % (stage, dockerfile))
    return out


def exec_form(text):
    """A JSON exec form (["a", "b"]) or a shell form."""
    text = text.strip()
    if text.startswith("["):
        return json.loads(text)
    return ["/bin/sh", "-c", text]


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Root(object):
    """A root file system with /proc, /dev and /sys mounted for chroot."""

    def __init__(self, path):
        self.path = path
        self.mounted = []

    def mount(self):
        for src, opts in (("/proc", ["-t", "proc", "proc"]), ("/sys", ["--rbind", "/sys"]),
                          ("/dev", ["--rbind", "/dev"])):
            target = os.path.join(self.path, src.lstrip("/"))
            os.makedirs(target, exist_ok=True)
            subprocess.run(["mount"] + opts + [target], check=True)
            if src != "/proc":
                subprocess.run(["mount", "--make-rslave", target], check=True)
            self.mounted.append(target)
        shutil.copy("/etc/resolv.conf", os.path.join(self.path, "etc", "resolv.conf"))

    def bind(self, src, dst):
        target = os.path.join(self.path, dst.lstrip("/"))
        subprocess.run(["mount", "--bind", src, target], check=True)
        self.mounted.append(target)

    def umount(self):
        for target in reversed(self.mounted):
            subprocess.run(["umount", "-R", target], stderr=subprocess.DEVNULL)
        self.mounted = []

    def still_mounted(self):
        """Mount points left under the tree: deleting it then would reach the host's /dev."""
        prefix = os.path.realpath(self.path) + "/"
        with open("/proc/self/mounts") as f:
            return [l.split()[1] for l in f if l.split()[1].startswith(prefix)]

    def run(self, argv, env, user=None, check=True, **kw):
        cmd = ["chroot"]
        if user:
            cmd.append("--userspec=" + user)
        cmd += [self.path] + argv
        r = subprocess.run(cmd, env=env, **kw)
        if check and r.returncode != 0:
            fail("%s exited with %d" % (" ".join(argv)[:200], r.returncode))
        return r


def base_rootfs(cache_dir):
    """A fresh Debian 12 minbase tree (debootstrap once, then from the cached tarball)."""
    os.makedirs(cache_dir, exist_ok=True)
    tarball = os.path.join(cache_dir, "bookworm-minbase.tar")
    work = tempfile.mkdtemp(prefix="lw-image-", dir=cache_dir)
    root = os.path.join(work, "root")
    if not os.path.exists(tarball):
        if shutil.which("debootstrap") is None:
            fail("debootstrap not found (scripts/install-deps.sh installs it)")
        note("debootstrap --variant=minbase bookworm (once; cached in %s) ..." % tarball)
        t0 = time.monotonic()
        r = subprocess.run(["debootstrap", "--variant=minbase", "bookworm", root, MIRROR],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if r.returncode != 0:
            fail("debootstrap: " + r.stdout[-2000:])
        subprocess.run(["tar", "-C", root, "-cf", tarball + ".tmp", "."], check=True)
        os.replace(tarball + ".tmp", tarball)
        note("debootstrap done (%.0f s)" % (time.monotonic() - t0))
    else:
        os.makedirs(root)
        subprocess.run(["tar", "-C", root, "-xf", tarball], check=True)
    return work, root


def build_stage(args, stage, stages):
    """Emulates one stage on a fresh minbase tree: (work dir, Root, what the stage declared),
    appended to `stages` (which the caller cleans up) before anything is mounted."""
    steps = instructions(args.dockerfile, stage)
    work, path = base_rootfs(args.cache)
    root = Root(path)
    meta = {}
    stages.append((work, root, meta))
    root.mount()
    meta.update({"env": {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                    "HOME": "/root"},
            "user": None, "volumes": [], "health": None, "entry": [], "cmd": [], "workdir": "/"})
    env = meta["env"]
    t0 = time.monotonic()
    for word, text in steps:
        if word == "ENV":
            for item in shlex.split(text):
                k, _, v = item.partition("=")
                env[k] = v
        elif word == "COPY":
            parts = text.split()
            dst = parts[-1]
            if parts[0].startswith("--from="):
                if parts[1] != "/src/build-release/proxy/lightwire":
                    fail("unexpected COPY --from: " + text)
                srcs = [args.bin]  # the build stage's binary: the one built here
            else:
                srcs = [os.path.join(REPO, s) for s in parts[:-1]]
            for src in srcs:
                target = os.path.join(path, dst.lstrip("/"))
                if os.path.isdir(src):
                    shutil.copytree(src, target, dirs_exist_ok=True,
                                    ignore=shutil.ignore_patterns("__pycache__"))
                    continue
                if dst.endswith("/"):
                    os.makedirs(target, exist_ok=True)
                    target = os.path.join(target, os.path.basename(src))
                os.makedirs(os.path.dirname(target), exist_ok=True)
                shutil.copy2(src, target)
            note("%s: COPY %s" % (stage, text))
        elif word == "RUN":
            note("%s: RUN %s ..." % (stage, text[:80]))
            root.run(["/bin/sh", "-c", text], env, user=meta["user"], stdout=subprocess.DEVNULL)
        elif word == "USER":
            meta["user"] = text
        elif word == "WORKDIR":
            meta["workdir"] = text
        elif word == "VOLUME":
            meta["volumes"] = exec_form(text)
        elif word == "HEALTHCHECK":
            meta["health"] = exec_form(text.split(" CMD ", 1)[1])
        elif word == "ENTRYPOINT":
            meta["entry"] = exec_form(text)
        elif word == "CMD":
            meta["cmd"] = exec_form(text)
        elif word in ("EXPOSE", "STOPSIGNAL", "ARG"):
            pass
        else:
            fail("instruction %s not emulated" % word)
    note("%s: stage done (%.0f s); user %s, volumes %s" % (
        stage, time.monotonic() - t0, meta["user"], meta["volumes"]))
    return work, root, meta


def start_sidecar(root, meta, argv, env, log_path):
    """argv as the container runs it (ENTRYPOINT + CMD) as USER; waits for its socket."""
    log = open(log_path, "w")
    proc = subprocess.Popen(["chroot", "--userspec=" + meta["user"], root.path] + argv, env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    sock = os.path.join(root.path, "run", "lightwire", "lightwire.sock")
    deadline = time.monotonic() + 30
    while not os.path.exists(sock):
        if proc.poll() is not None or time.monotonic() > deadline:
            with open(log_path) as f:
                fail("the sidecar did not start:\n" + f.read()[-3000:])
        time.sleep(0.1)
    return proc, sock


def stop(proc, what):
    proc.send_signal(signal.SIGTERM)
    if proc.wait(timeout=30) != 0:
        fail("%s exited with %d on SIGTERM" % (what, proc.returncode))
    note("%s: SIGTERM, clean exit" % what)


def check_sidecar(root, meta, work):
    """The image as `docker run lightwire` starts it (world size 1, on free loopback ports: the
    chroot shares this machine's network)."""
    r = root.run(["ldd", "/usr/local/bin/lightwire"], meta["env"], stdout=subprocess.PIPE,
                 text=True)
    if "not found" in r.stdout:
        fail("ldd in the image:\n" + r.stdout)
    note("ldd: every library found (%d)" % r.stdout.count("=>"))
    env = dict(meta["env"], LIGHTWIRE_ADMIN__LISTEN="127.0.0.1:%d" % free_port(),
               LIGHTWIRE_PEER__LISTEN="127.0.0.1:%d" % free_port(), LIGHTWIRE_CONTROL__TCP="")
    argv = meta["entry"] + meta["cmd"]
    proc, sock = start_sidecar(root, meta, argv, env, os.path.join(work, "sidecar.log"))
    try:
        if os.path.dirname(sock)[len(root.path):] not in meta["volumes"]:
            fail("the socket's directory is not a VOLUME")
        note("started %s as %s" % (" ".join(argv), meta["user"]))
        r = root.run(meta["health"], env, user=meta["user"], check=False, stdout=subprocess.PIPE,
                     stderr=subprocess.STDOUT, text=True)
        if r.returncode != 0:
            fail("HEALTHCHECK %s: %d %s" % (meta["health"], r.returncode, r.stdout))
        note("HEALTHCHECK %s: healthy" % " ".join(meta["health"]))
        r = root.run(["lightwire", "health", "--ready"], env, user=meta["user"], check=False,
                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if r.returncode != 0:
            fail("lightwire health --ready: " + r.stdout)
        note(r.stdout.strip())
        # A gradient through the socket in the volume, from outside the "container".
        sys.path.insert(0, os.path.join(REPO, "clients", "python"))
        import numpy as np
        import lightwire
        g = np.arange(4096, dtype=np.float32) / 7
        with lightwire.Client(socket_path=sock, timeout=30) as c:
            out = c.emit_gradient(g, "image.check", 0)
            status = c.status()
        if not np.array_equal(out, g):
            fail("the world-size-1 average differs from the gradient")
        note("emit_gradient through %s: ok; cuda: %s" % (
            sock[len(root.path):], json.dumps(status.get("cuda", {}))[:160]))
    except BaseException:
        proc.kill()
        raise
    stop(proc, "sidecar")


def check_trainer(side, side_meta, trainer, trainer_meta, work):
    """One node of docker/compose.yml, world size 1: the sidecar service's command and config
    file, the trainer service's command and environment in the trainer image, sharing the socket
    volume (a bind mount), /dev/shm and the user, as the compose file has them share."""
    import yaml
    with open(os.path.join(REPO, "docker", "compose.yml"), encoding="utf-8") as f:
        compose = yaml.safe_load(f)
    svc_side, svc_trainer = compose["services"]["lightwire-0"], compose["services"]["trainer-0"]
    if "user" in svc_trainer:
        fail("compose sets a trainer user; this check runs the image's")
    if trainer_meta["user"] != side_meta["user"]:
        fail("the trainer image runs as %s, the sidecar as %s" % (trainer_meta["user"],
                                                                 side_meta["user"]))
    conf_dst = os.path.join(side.path, "etc", "lightwire", "lightwire.yaml")
    shutil.copy(os.path.join(REPO, "docker", "config", "lightwire.yaml"), conf_dst)
    sock_dir = "/run/lightwire"
    os.makedirs(os.path.join(trainer.path, sock_dir.lstrip("/")), exist_ok=True)
    trainer.bind(os.path.join(side.path, sock_dir.lstrip("/")), sock_dir)
    env = dict(side_meta["env"], LIGHTWIRE_RANK="0", LIGHTWIRE_WORLD_SIZE="1",
               LIGHTWIRE_PEER__PEERS="", LIGHTWIRE_PEER__SECRET="check-image",
               LIGHTWIRE_ADMIN__LISTEN="127.0.0.1:%d" % free_port(),
               LIGHTWIRE_PEER__LISTEN="127.0.0.1:%d" % free_port())
    argv = side_meta["entry"] + svc_side["command"]
    proc, _ = start_sidecar(side, side_meta, argv, env, os.path.join(work, "sidecar-compose.log"))
    try:
        note("started %s (compose's lightwire-0, world size 1)" % " ".join(argv))
        tenv = dict(trainer_meta["env"])
        tenv.update({k: str(v) for k, v in svc_trainer["environment"].items()})
        tenv.update({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                     "MASTER_PORT": str(free_port()), "HOME": trainer_meta["workdir"]})
        cmd = [re.sub(r"\$\{LIGHTWIRE_DEMO_STEPS:-\d+\}", "40", c) for c in svc_trainer["command"]]
        note("trainer: %s ..." % " ".join(cmd))
        t0 = time.monotonic()
        r = trainer.run(["/bin/sh", "-c", "cd %s && exec %s" % (
            shlex.quote(trainer_meta["workdir"]), " ".join(shlex.quote(c) for c in cmd))],
            tenv, user=trainer_meta["user"], check=False, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, timeout=600)
        out = r.stdout
        m = re.search(r"lightwire: final loss ([0-9.]+).* (\d+) fallbacks", out)
        if r.returncode != 0 or not m or m.group(2) != "0":
            fail("the trainer (exit %d):\n%s" % (r.returncode, out[-3000:]))
        note("trainer: %s (%.0f s)" % (m.group(0), time.monotonic() - t0))
    except BaseException:
        proc.kill()
        raise
    stop(proc, "sidecar (compose)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", default=os.path.join(REPO, "build-release", "proxy", "lightwire"),
                    help="the sidecar built here (stands for the build stage's output)")
    ap.add_argument("--dockerfile", default=os.path.join(REPO, "docker", "Dockerfile"))
    ap.add_argument("--cache", default=os.path.join(REPO, "build-image-cache"))
    ap.add_argument("--keep", action="store_true", help="keep the emulated images' trees")
    ap.add_argument("--sidecar-only", action="store_true",
                    help="skip the trainer stage (Debian's PyTorch: a larger download)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        fail("needs root (debootstrap, chroot, mounts)")
    if not os.access(args.bin, os.X_OK):
        fail("no sidecar binary at %s (bash scripts/build.sh release)" % args.bin)

    stages = []
    ok = False
    try:
        side = build_stage(args, "sidecar", stages)
        check_sidecar(side[1], side[2], side[0])
        if not args.sidecar_only:
            trainer = build_stage(args, "trainer", stages)
            check_trainer(side[1], side[2], trainer[1], trainer[2], side[0])
        ok = True
    finally:
        for work, root, _ in reversed(stages):
            root.umount()
            left = root.still_mounted()
            if left:
                ok = False
                note("still mounted, not deleting %s: %s" % (work, " ".join(left)))
            elif args.keep:
                note("kept " + root.path)
            else:
                shutil.rmtree(work, ignore_errors=True)
    note("all checks passed" if ok else "failed")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
