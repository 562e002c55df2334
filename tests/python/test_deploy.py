"""Deployment files (docs/deploy.md): docker/Dockerfile, docker/compose.yml, docker/k8s.

No container engine or cluster here, so the files are checked against what they refer to: the
repository's files, the built binary's shared libraries and Debian packages, the sidecar's own
configuration checker (`lightwire serve --check-config`) with the environment each container
gives it, Debian's docker-compose (`config`), and, where kubectl is installed, kustomize. The
trainer command of the compose file is also run for real: two sidecars with the compose
configuration and two torchrun-launched trainers, on loopback.
"""

import os
import re
import shlex
import shutil
import subprocess
import sys
import time

import pytest
import yaml

from conftest import LIGHTWIRE_BIN, REPO, free_tcp_port

DOCKER = os.path.join(REPO, "docker")
K8S = os.path.join(DOCKER, "k8s")
PYTHON = os.environ.get("PYTHON") or sys.executable


def need_binary():
    if not os.access(LIGHTWIRE_BIN, os.X_OK):
        pytest.fail("sidecar binary not found at %s (build it or set LIGHTWIRE_BIN)" % LIGHTWIRE_BIN)


# ---------------------------------------------------------------- helpers


def serve_defaults():
    """{config key: default} from `lightwire serve --help` ("[key, ENV; default X]")."""
    need_binary()
    out = subprocess.run([LIGHTWIRE_BIN, "serve", "--help"], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=30).stdout
    return {m.group(1): m.group(2) for m in
            re.finditer(r"\[([a-z_.]+), LIGHTWIRE_[A-Z_]+; default ([^\]]*)\]", out)}


def check_config(path, env):
    """`lightwire serve --check-config path` with exactly `env` (plus PATH)."""
    need_binary()
    e = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    e.update(env)
    return subprocess.run([LIGHTWIRE_BIN, "serve", "--check-config", path], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, timeout=30, env=e)


def dockerfile_stages():
    """{stage name: [(INSTRUCTION, arguments)]} of docker/Dockerfile (continuations joined)."""
    with open(os.path.join(DOCKER, "Dockerfile"), encoding="utf-8") as f:
        text = f.read()
    lines, cur = [], ""
    for raw in text.splitlines():
        s = raw.strip()
        if not cur and (not s or s.startswith("#")):
            continue
        if s.startswith("#"):
            continue  # a comment inside a continued instruction
        if s.endswith("\\"):
            cur += s[:-1] + " "
            continue
        lines.append(cur + s)
        cur = ""
    stages, name, args = {}, None, {}
    for line in lines:
        instr, _, rest = line.partition(" ")
        instr = instr.upper()
        if instr == "ARG" and name is None:
            k, _, v = rest.partition("=")
            args[k.strip()] = v.strip()
            continue
        if instr == "FROM":
            m = re.match(r"(\S+)\s+AS\s+(\S+)$", rest.strip(), re.I)
            assert m, "every stage is named: FROM %s" % rest
            base = re.sub(r"\$\{(\w+)\}", lambda g: args.get(g.group(1), ""), m.group(1))
            name = m.group(2)
            stages[name] = [("FROM", base)]
            continue
        assert name is not None, "instruction before FROM: " + line
        stages[name].append((instr, rest.strip()))
    return stages


def instr(stage, kind):
    return [a for i, a in stage if i == kind]


def install_deps_list(name):
    """The packages of one array (runtime=(...)) of scripts/install-deps.sh."""
    with open(os.path.join(REPO, "scripts", "install-deps.sh"), encoding="utf-8") as f:
        text = f.read()
    m = re.search(r"^%s=\((.*?)^\)" % name, text, re.S | re.M)
    assert m, "no %s=(...) in install-deps.sh" % name
    words = []
    for line in m.group(1).splitlines():
        words += line.split("#", 1)[0].split()
    return words


def compose(*files, secret="s3cret-for-tests", args=("config",)):
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.fail("docker-compose not found: scripts/install-deps.sh installs Debian's")
    env = dict(os.environ)
    env.pop("LIGHTWIRE_SECRET", None)
    env.pop("LIGHTWIRE_DEMO_STEPS", None)
    if secret is not None:
        env["LIGHTWIRE_SECRET"] = secret
    cmd = [exe]
    for f in files or ("compose.yml",):
        cmd += ["-f", os.path.join(DOCKER, f)]
    return subprocess.run(cmd + list(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, timeout=120, cwd=REPO, env=env)


def compose_model(*files):
    r = compose(*files)
    assert r.returncode == 0, r.stderr
    return yaml.safe_load(r.stdout)


def k8s_docs():
    """Every object of every YAML file under docker/k8s, with its file."""
    out = []
    for root, _, files in os.walk(K8S):
        for fn in sorted(files):
            if fn.endswith((".yaml", ".yml")):
                path = os.path.join(root, fn)
                with open(path, encoding="utf-8") as f:
                    for doc in yaml.safe_load_all(f):
                        if doc is not None:
                            out.append((os.path.relpath(path, K8S), doc))
    return out


def k8s_object(kind):
    """The one object of `kind` outside the overlays' patches (docker/k8s/gpu, job-gpu)."""
    found = [d for p, d in k8s_docs()
             if d.get("kind") == kind and not p.startswith(("gpu/", "job-gpu/"))]
    assert len(found) == 1, "expected one %s, found %d" % (kind, len(found))
    return found[0]


def container(pod_spec, name):
    """A container of the pod, regular or init (the Job's native sidecar is one)."""
    found = [c for c in pod_spec["containers"] + pod_spec.get("initContainers", [])
             if c["name"] == name]
    assert len(found) == 1, name
    return found[0]


def mounts(c):
    return {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}


# ---------------------------------------------------------------- Dockerfile


def test_dockerfile_stages_build_as_ci_does():
    stages = dockerfile_stages()
    assert list(stages) == ["build", "build-cpu", "prebuilt", "binary", "sidecar", "trainer"]
    for name in ("build", "build-cpu", "sidecar", "trainer"):
        assert stages[name][0] == ("FROM", "debian:12"), (name, stages[name][0])
    # The sidecar's binary comes from the stage LW_BINARY names: `build` by default (CUDA),
    # `build-cpu`, or `prebuilt` (the context's release binary, what the container test uses).
    assert stages["binary"][0] == ("FROM", "build") and len(stages["binary"]) == 1
    assert stages["prebuilt"] == [("FROM", "scratch"), (
        "COPY", "build-release/proxy/lightwire /src/build-release/proxy/lightwire")]
    cpu = " ".join(instr(stages["build-cpu"], "RUN"))
    assert "bash scripts/install-deps.sh build" in cpu
    assert "bash scripts/build.sh release build-release" in cpu and "nvidia" not in cpu
    build = " ".join(instr(stages["build"], "RUN"))
    # NVIDIA's CUDA repository for Debian 12, then the same scripts as CI.
    assert "developer.download.nvidia.com/compute/cuda/repos/debian12/x86_64/cuda-keyring" in build
    assert "cuda-nvcc-" in build and "cuda-cudart-dev-" in build and "cuda-cccl-" in build
    assert "bash scripts/install-deps.sh build" in build
    assert "bash scripts/build.sh release build-release" in build
    assert "lightwire_kernels_cuda" in build  # refuses a build without the CUDA kernels
    # Every file the stages copy from the context exists (and is not excluded by .dockerignore).
    with open(os.path.join(REPO, ".dockerignore"), encoding="utf-8") as f:
        ignored = [l.strip() for l in f if l.strip() and not l.startswith("#")]
    assert ".git" in ignored and "build*/" in ignored
    for name, stage in stages.items():
        for args in instr(stage, "COPY"):
            words = args.split()
            if words[0].startswith("--from="):
                assert words[0][len("--from="):] in stages
                continue
            for src in words[:-1]:
                if name == "prebuilt":
                    # Re-included by .dockerignore; built by the test command before the tests.
                    assert "!" + src in ignored, src
                elif src != ".":
                    assert os.path.exists(os.path.join(REPO, src)), (name, src)
                    assert not src.startswith("build"), src
    # The runtime stage installs exactly install-deps.sh's runtime list.
    sidecar = stages["sidecar"]
    assert any("install-deps.sh runtime" in r for r in instr(sidecar, "RUN"))
    assert instr(sidecar, "COPY")[-1] == (
        "--from=binary /src/build-release/proxy/lightwire /usr/local/bin/lightwire")


def test_sidecar_image_runs_unprivileged_with_a_healthcheck():
    stages = dockerfile_stages()
    sidecar, trainer = stages["sidecar"], stages["trainer"]
    defaults = serve_defaults()
    # Same non-root uid in both images: the sidecar maps only its client's user's segments.
    assert instr(sidecar, "USER") == ["10001:10001"]
    assert instr(trainer, "USER") == ["10001:10001"]
    # The volumes are the default socket directory and state directory.
    vols = yaml.safe_load(instr(sidecar, "VOLUME")[0])
    assert sorted(vols) == sorted([os.path.dirname(defaults["control.socket"]),
                                   defaults["state.dir"]])
    # The exposed ports are the default peer and admin ports.
    ports = instr(sidecar, "EXPOSE")[0].split()
    assert sorted(ports) == sorted([defaults["peer.listen"].rsplit(":", 1)[1],
                                    defaults["admin.listen"].rsplit(":", 1)[1]])
    # HEALTHCHECK runs `lightwire health`, a real subcommand of the binary.
    hc = instr(sidecar, "HEALTHCHECK")[0]
    cmd = yaml.safe_load(hc.split(" CMD ", 1)[1])
    assert cmd[:2] == ["lightwire", "health"]
    r = subprocess.run([LIGHTWIRE_BIN] + cmd[1:] + ["--help"], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=30)
    assert r.returncode == 0 and "/healthz" in r.stdout, r.stdout
    assert instr(sidecar, "ENTRYPOINT") == ['["lightwire"]']
    # The trainer stage holds the client and the example the compose file and pods run.
    copies = " ".join(instr(trainer, "COPY"))
    assert "/opt/lightwire/python/lightwire" in copies
    assert "/opt/lightwire/examples/train_ddp.py" in copies


def _package_of(path):
    for p in (os.path.realpath(path), path):
        r = subprocess.run(["dpkg-query", "-S", p], stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, text=True)
        if r.returncode == 0:
            return r.stdout.split(":", 1)[0].strip()
    pytest.fail("no Debian package holds %s" % path)


def _depends_closure(packages):
    """The packages and everything they depend on, as installed here (dpkg's Depends and
    Pre-Depends; alternatives: whichever is installed)."""
    seen, todo = set(), list(packages)
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        r = subprocess.run(["dpkg-query", "-W", "-f=${Depends}, ${Pre-Depends}", p],
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        for dep in r.stdout.split(","):
            for alt in dep.split("|"):
                n = alt.strip().split(" ")[0].split(":")[0]
                if n and subprocess.run(["dpkg-query", "-W", n], stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL).returncode == 0:
                    todo.append(n)
                    break
    return seen


def test_runtime_packages_cover_the_binarys_libraries():
    """The runtime stage's packages (install-deps.sh runtime) and what debian:12 already has
    (apt's dependencies) provide every shared library `ldd` lists for the built sidecar: the
    image needs no -dev package and no CUDA runtime (linked statically)."""
    need_binary()
    out = subprocess.run(["ldd", LIGHTWIRE_BIN], stdout=subprocess.PIPE, text=True,
                         timeout=30).stdout
    libs = re.findall(r"=> (/\S+)", out)
    assert libs, out
    assert not any("libcudart" in l for l in libs), "the CUDA runtime must be linked statically"
    runtime = install_deps_list("runtime")
    available = _depends_closure(runtime) | _depends_closure(["apt"])
    needed = {_package_of(l) for l in libs}
    assert needed <= available, "not in the runtime stage: %s" % sorted(needed - available)
    # ... and nothing listed is unneeded.
    assert set(runtime) <= needed, sorted(set(runtime) - needed)


# ---------------------------------------------------------------- compose


def test_compose_config_is_valid():
    """`docker-compose config -q` (how docs/deploy.md checks the compose files), with and without
    the GPU file; a missing job secret is refused with a message that names it."""
    for files in (("compose.yml",), ("compose.yml", "compose.gpu.yml")):
        r = compose(*files, args=("config", "-q"))
        assert r.returncode == 0, (files, r.stderr)
    r = compose(secret=None, args=("config", "-q"))
    assert r.returncode != 0 and "set LIGHTWIRE_SECRET" in r.stderr, r.stderr


def test_compose_wires_trainers_to_their_sidecars():
    model = compose_model()
    svc = model["services"]
    defaults = serve_defaults()
    with open(os.path.join(DOCKER, "config", "lightwire.yaml"), encoding="utf-8") as f:
        conf = yaml.safe_load(f)
    sock_dir = os.path.dirname(conf["control"]["socket"])
    # One template for every rank's address (peer.peers with {rank}).
    assert "," not in conf["peer"]["peers"] and "{rank}" in conf["peer"]["peers"]
    peers = [conf["peer"]["peers"].replace("{rank}", str(r)) for r in range(conf["world_size"])]
    assert len(peers) == 2
    stages = dockerfile_stages()
    for rank, peer in enumerate(peers):
        host, port = peer.rsplit(":", 1)
        side, trainer = svc[host], svc["trainer-%d" % rank]
        assert port == conf["peer"]["listen"].rsplit(":", 1)[1]
        assert side["build"]["target"] in stages and trainer["build"]["target"] in stages
        assert side["environment"]["LIGHTWIRE_RANK"] == str(rank)
        assert side["environment"]["LIGHTWIRE_PEER__SECRET"] == "s3cret-for-tests"
        # The node's IPC (shm, CUDA IPC) and PID namespaces belong to neither the sidecar nor
        # the trainer but to node-N, which only sleeps: a sidecar's crash leaves both to the
        # trainer (tests/python/test_containers.py kills one).
        node = svc["node-%d" % rank]
        assert node["ipc"] == "shareable" and node["entrypoint"] == ["sleep", "infinity"]
        assert node["init"] is True and node["network_mode"] == "none"
        shm = node["shm_size"]
        assert re.fullmatch(r"\d+gb", str(shm)) and int(str(shm)[:-2]) >= 1, shm
        for c in (side, trainer):
            assert c["ipc"] == "service:node-%d" % rank and c["pid"] == "service:node-%d" % rank
            assert "node-%d" % rank in c["depends_on"]
        vol = lambda s: {v.split(":")[1]: v.split(":")[0] for v in s["volumes"]}
        assert vol(side)[sock_dir] == vol(trainer)[sock_dir] == "socket-%d" % rank
        assert vol(side)["/etc/lightwire/lightwire.yaml"] == os.path.join(
            DOCKER, "config", "lightwire.yaml")
        assert side["command"] == ["serve", "--config", "/etc/lightwire/lightwire.yaml"]
        assert trainer["environment"]["LIGHTWIRE_SOCKET"] == conf["control"]["socket"]
        # What torchrun would give the trainer of node `rank`.
        assert trainer["command"][:2] == ["python3", "/opt/lightwire/examples/train_ddp.py"]
        tenv = trainer["environment"]
        assert (tenv["RANK"], tenv["WORLD_SIZE"]) == (str(rank), str(len(peers)))
        assert tenv["MASTER_ADDR"] == "trainer-0"
    # Every host path mounted exists; Prometheus scrapes the sidecars' admin ports; Grafana's
    # data source is the Prometheus service.
    for s in svc.values():
        for v in s.get("volumes", []):
            src = v.split(":")[0]
            if src.startswith("/"):
                assert os.path.exists(src), src
    with open(os.path.join(DOCKER, "prometheus", "prometheus.yml"), encoding="utf-8") as f:
        prom = yaml.safe_load(f)
    admin_port = conf["admin"]["listen"].rsplit(":", 1)[1]
    targets = prom["scrape_configs"][0]["static_configs"][0]["targets"]
    assert sorted(targets) == sorted("%s:%s" % (p.rsplit(":", 1)[0], admin_port) for p in peers)
    assert any(v.endswith(":/etc/prometheus:ro") for v in svc["prometheus"]["volumes"])
    with open(os.path.join(DOCKER, "grafana", "provisioning", "datasources", "prometheus.yml"),
              encoding="utf-8") as f:
        ds = yaml.safe_load(f)["datasources"][0]
    assert ds["url"] == "http://prometheus:9090"
    assert "prometheus" in svc
    # The GPU file gives the GPUs to every lightwire container, nothing else.
    gpu = compose_model("compose.yml", "compose.gpu.yml")["services"]
    with_gpus = {n for n, s in gpu.items()
                 if s.get("deploy", {}).get("resources", {}).get("reservations")}
    assert with_gpus == {"lightwire-0", "lightwire-1", "trainer-0", "trainer-1"}
    assert defaults["admin.listen"].endswith(":" + admin_port)


def test_compose_sidecar_config_checks():
    """What each compose sidecar is given (its file and environment) passes --check-config."""
    svc = compose_model()["services"]
    path = os.path.join(DOCKER, "config", "lightwire.yaml")
    for name in ("lightwire-0", "lightwire-1"):
        r = check_config(path, {k: str(v) for k, v in svc[name]["environment"].items()})
        assert r.returncode == 0 and r.stdout.strip() == path + ": ok", (name, r.stderr)
    r = check_config(path, {"LIGHTWIRE_RANK": "0"})
    assert r.returncode != 0 and "peer.secret must be set" in r.stderr, r.stderr


# ---------------------------------------------------------------- Kubernetes


def _pod_env(c, ordinal, config_maps):
    """A container's environment as the kubelet gives it to pod `ordinal`."""
    env = {}
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = str(e["value"])
            continue
        src = e["valueFrom"]
        if "fieldRef" in src:
            assert src["fieldRef"]["fieldPath"] in (
                "metadata.labels['apps.kubernetes.io/pod-index']",  # StatefulSet
                "metadata.annotations['batch.kubernetes.io/job-completion-index']"), src  # Job
            env[e["name"]] = str(ordinal)
        else:
            ref = src["configMapKeyRef"]
            env[e["name"]] = config_maps[ref["name"]][ref["key"]]
    return env


def _secret_file(tmp_path, text):
    f = tmp_path / "peer-secret"
    f.write_text(text)
    f.chmod(0o440)  # the volume's defaultMode
    return str(f)


def test_k8s_manifests_hang_together():
    sts = k8s_object("StatefulSet")
    svc = k8s_object("Service")
    cm = k8s_object("ConfigMap")
    secret = k8s_object("Secret")
    mon = k8s_object("ServiceMonitor")
    conf = yaml.safe_load(cm["data"]["lightwire.yaml"])
    spec = sts["spec"]
    pod = spec["template"]["spec"]
    labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    # Peers from the headless Service, published before the pods are ready; Parallel start.
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert spec["serviceName"] == svc["metadata"]["name"]
    assert svc["spec"]["selector"].items() <= labels.items()
    assert spec["podManagementPolicy"] == "Parallel"
    # The world size is the ConfigMap's world-size in both containers, = replicas; the file has
    # none of its own, and its peers are one template.
    n = spec["replicas"]
    cms = {cm["metadata"]["name"]: cm["data"]}
    side, trainer = container(pod, "sidecar"), container(pod, "trainer")
    assert "world_size" not in conf
    assert _pod_env(side, 0, cms)["LIGHTWIRE_WORLD_SIZE"] == _pod_env(trainer, 0, cms)["WORLD_SIZE"] \
        == str(n)
    peer_port = conf["peer"]["listen"].rsplit(":", 1)[1]
    assert conf["peer"]["peers"] == "%s-{rank}.%s:%s" % (
        sts["metadata"]["name"], svc["metadata"]["name"], peer_port)
    ports = {p["name"]: p["containerPort"] for c in pod["containers"] for p in c.get("ports", [])}
    assert str(ports["peer"]) == peer_port
    assert str(ports["admin"]) == conf["admin"]["listen"].rsplit(":", 1)[1]
    for p in svc["spec"]["ports"]:
        assert p["targetPort"] in ports and ports[p["targetPort"]] == p["port"], p
    # Probes on the admin listener: ready = /readyz, alive = /healthz.
    assert side["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "admin"}
    assert side["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "admin"}
    # Shared socket directory, in-memory /dev/shm, shared process namespace, one non-root uid.
    vols = {v["name"]: v for v in pod["volumes"]}
    sock_dir = os.path.dirname(conf["control"]["socket"])
    for c in (side, trainer):
        m = mounts(c)
        assert m[sock_dir] == "socket" and m["/dev/shm"] == "dshm", c["name"]
        assert set(m.values()) <= set(vols), c["name"]
        assert c["resources"]["requests"]["cpu"] and c["resources"]["limits"]["memory"]
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert vols["dshm"]["emptyDir"]["medium"] == "Memory"
    assert pod["shareProcessNamespace"] is True
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 10001
    assert mounts(side)[conf["state"]["dir"]] == "state"
    assert conf["threads"] == int(side["resources"]["requests"]["cpu"])
    # The config file is the ConfigMap's key, where the sidecar's args say.
    assert side["args"][:2] == ["serve", "--config"]
    cfg_dir, cfg_key = os.path.split(side["args"][2])
    assert mounts(side)[cfg_dir] == "config"
    assert vols["config"]["configMap"]["name"] == cm["metadata"]["name"]
    assert cfg_key in cm["data"]
    assert vols["config"]["configMap"]["items"] == [{"key": cfg_key, "path": cfg_key}]
    # The job secret is the Secret (whose value is left for the user to fill in) as a file where
    # peer.secret_file says, in the sidecar only, readable by the pod's group and nobody else;
    # never an environment variable.
    sec_dir, sec_name = os.path.split(conf["peer"]["secret_file"])
    assert mounts(side)[sec_dir] == "secret" and "secret" not in mounts(trainer).values()
    sv = vols["secret"]["secret"]
    assert sv["secretName"] == secret["metadata"]["name"]
    assert [i["path"] for i in sv["items"]] == [sec_name]
    assert sv["items"][0]["key"] in secret["stringData"]
    assert sv["defaultMode"] == 0o440 and pod["securityContext"]["fsGroup"] == 10001
    assert not any("SECRET" in e["name"] for c in pod["containers"] for e in c.get("env", []))
    # Scrape annotations and the ServiceMonitor point at the admin port.
    ann = spec["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/port"] == str(ports["admin"])
    assert mon["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert mon["spec"]["endpoints"][0]["port"] in {p["name"] for p in svc["spec"]["ports"]}
    # The trainer's view matches: one node per pod, rendezvous on pod 0 through the Service.
    assert trainer["command"][:2] == ["python3", "/opt/lightwire/examples/train_ddp.py"]
    tenv = _pod_env(trainer, 1, cms)
    assert (tenv["RANK"], tenv["WORLD_SIZE"]) == ("1", str(n))
    assert tenv["MASTER_ADDR"] == "%s-0.%s" % (sts["metadata"]["name"], svc["metadata"]["name"])
    assert tenv["MASTER_PORT"] == str(ports["rendezvous"])
    assert tenv["LIGHTWIRE_SOCKET"] == conf["control"]["socket"]
    # The kustomizations list files that exist; the GPU patches name their workload's containers
    # where that workload has them (the Job's sidecar is an init container).
    job = k8s_object("Job")
    workloads = {"StatefulSet": sts, "Job": job}
    for rel in ("common", "base", "gpu", "job", "job-gpu"):
        with open(os.path.join(K8S, rel, "kustomization.yaml"), encoding="utf-8") as f:
            k = yaml.safe_load(f)
        for res in k.get("resources", []):
            assert os.path.exists(os.path.join(K8S, rel, res)), (rel, res)
        for p in k.get("patches", []):
            with open(os.path.join(K8S, rel, p["path"]), encoding="utf-8") as f:
                patch = yaml.safe_load(f)
            target = workloads[patch["kind"]]
            assert patch["metadata"]["name"] == target["metadata"]["name"]
            for field in ("containers", "initContainers"):
                names = {c["name"] for c in patch["spec"]["template"]["spec"].get(field, [])}
                have = {c["name"] for c in target["spec"]["template"]["spec"].get(field, [])}
                assert names <= have, (rel, field, names)


def test_k8s_configmap_passes_check_config(tmp_path):
    """Every pod's sidecar accepts the ConfigMap's file with the environment the pod gives it and
    a filled-in Secret at the mounted path (moved to a temp dir); the Secret as committed (empty)
    is refused with a clear error, and so is a pod beyond world-size."""
    sts = k8s_object("StatefulSet")
    cm = k8s_object("ConfigMap")
    secret = k8s_object("Secret")
    side = container(sts["spec"]["template"]["spec"], "sidecar")
    cms = {cm["metadata"]["name"]: cm["data"]}
    path = str(tmp_path / side["args"][2].rsplit("/", 1)[1])
    with open(path, "w", encoding="utf-8") as f:
        f.write(cm["data"]["lightwire.yaml"])
    mounted = yaml.safe_load(cm["data"]["lightwire.yaml"])["peer"]["secret_file"]

    def env(ordinal, secret_text):
        e = _pod_env(side, ordinal, cms)
        e["LIGHTWIRE_PEER__SECRET_FILE"] = _secret_file(tmp_path, secret_text)
        return e
    # `kubectl create secret --from-literal` writes no newline; a file written by echo has one.
    for text in ("0123456789abcdef0123456789abcdef", "0123456789abcdef0123456789abcdef\n"):
        for ordinal in range(sts["spec"]["replicas"]):
            r = check_config(path, env(ordinal, text))
            assert r.returncode == 0 and r.stdout.strip() == path + ": ok", (ordinal, r.stderr)
            assert "other users may read" not in r.stderr, r.stderr
    r = check_config(path, env(0, secret["stringData"]["peer-secret"]))
    assert r.returncode != 0 and "the file is empty" in r.stderr, r.stderr
    # Without the override the sidecar looks where the volume is mounted.
    r = check_config(path, _pod_env(side, 0, cms))
    assert r.returncode != 0 and "peer.secret_file " + mounted + ": cannot open" in r.stderr, r.stderr
    # A pod beyond world-size (replicas raised without the ConfigMap) is refused too.
    r = check_config(path, env(sts["spec"]["replicas"], "0123456789abcdef"))
    assert r.returncode != 0 and "rank" in r.stderr, r.stderr


def test_k8s_job_runs_the_same_pods_to_completion():
    """docker/k8s/job: an Indexed Job whose pods are the StatefulSet's, except that the sidecar is
    a native sidecar (init container, restartPolicy Always: stopped once the trainer is done),
    the rank is the completion index, and the pod template's restart policy is OnFailure. Same
    pod names (lightwire-<index> in the subdomain lightwire-peers), so the ConfigMap serves
    both; every node runs at once."""
    import copy
    sts, job = k8s_object("StatefulSet"), k8s_object("Job")
    svc, cm = k8s_object("Service"), k8s_object("ConfigMap")
    n = int(cm["data"]["world-size"])
    assert job["metadata"]["name"] == sts["metadata"]["name"]
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == n
    jpod, spod = copy.deepcopy(spec["template"]["spec"]), copy.deepcopy(sts["spec"]["template"]["spec"])
    assert jpod.pop("subdomain") == svc["metadata"]["name"] == sts["spec"]["serviceName"]
    assert jpod.pop("restartPolicy") == "OnFailure"
    assert spec["template"]["metadata"] == sts["spec"]["template"]["metadata"]
    assert svc["spec"]["selector"].items() <= spec["template"]["metadata"]["labels"].items()
    # The native sidecar: the StatefulSet's sidecar container plus restartPolicy Always.
    (side,) = jpod.pop("initContainers")
    assert side.pop("restartPolicy") == "Always"
    jpod["containers"] = [side] + jpod["containers"]
    index = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    ordinal = "metadata.labels['apps.kubernetes.io/pod-index']"
    for c in jpod["containers"]:
        for e in c.get("env", []):
            ref = e.get("valueFrom", {}).get("fieldRef")
            if ref is not None:
                assert ref["fieldPath"] == index, (c["name"], e)
                ref["fieldPath"] = ordinal
    strip = lambda pod: [{k: v for k, v in c.items()} for c in pod["containers"]]
    assert strip(jpod) == strip(spod)
    assert {k: v for k, v in jpod.items() if k != "containers"} == \
        {k: v for k, v in spod.items() if k != "containers"}


def test_kustomize_renders_both_variants():
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed (kustomize rendering is checked where it is)")
    rendered = {}
    for rel in ("base", "gpu", "job", "job-gpu"):
        r = subprocess.run([kubectl, "kustomize", os.path.join(K8S, rel)], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        rendered[rel] = {d["kind"]: d for d in yaml.safe_load_all(r.stdout)}
        workload = "Job" if rel.startswith("job") else "StatefulSet"
        assert set(rendered[rel]) == {"ConfigMap", "Service", workload}
        assert rendered[rel][workload]["metadata"]["labels"]["app.kubernetes.io/part-of"] == "lightwire"
    assert rendered["job"]["ConfigMap"] == rendered["base"]["ConfigMap"]
    pod = rendered["gpu"]["StatefulSet"]["spec"]["template"]["spec"]
    assert container(pod, "trainer")["resources"]["limits"]["nvidia.com/gpu"] == 1
    env = {e["name"]: e for e in container(pod, "sidecar")["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    assert "LIGHTWIRE_WORLD_SIZE" in env and "LIGHTWIRE_RANK" in env  # merged, not replaced
    base_pod = rendered["base"]["StatefulSet"]["spec"]["template"]["spec"]
    assert "nvidia.com/gpu" not in container(base_pod, "trainer")["resources"]["limits"]
    # The Job's GPU variant makes the same changes; its sidecar stays a native sidecar.
    jpod = rendered["job-gpu"]["Job"]["spec"]["template"]["spec"]
    assert container(jpod, "trainer")["resources"]["limits"]["nvidia.com/gpu"] == 1
    (side,) = jpod["initContainers"]
    jenv = {e["name"]: e for e in side["env"]}
    assert side["restartPolicy"] == "Always"
    assert {k: jenv[k] for k in ("NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES")} == \
        {k: env[k] for k in ("NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES")}
    assert "LIGHTWIRE_WORLD_SIZE" in jenv and "LIGHTWIRE_RANK" in jenv
    assert "nvidia.com/gpu" not in container(
        rendered["job"]["Job"]["spec"]["template"]["spec"], "trainer")["resources"]["limits"]


# ---------------------------------------------------------------- the compose job, for real


def test_compose_job_runs_on_loopback(tmp_path):
    """The compose file's commands, run as processes: two sidecars started with the compose
    configuration (host names, ports and paths moved to loopback and a temp dir) and two trainers
    started with the compose file's command and environment. The trainers start first and wait
    for their sidecars' /readyz, as containers started together do."""
    need_binary()
    svc = compose_model()["services"]
    conf_path = os.path.join(DOCKER, "config", "lightwire.yaml")
    peer_ports = [free_tcp_port(), free_tcp_port()]
    master_port = free_tcp_port()
    peers = ",".join("127.0.0.1:%d" % p for p in peer_ports)
    procs, logs = [], []

    def start(cmd, env, name):
        log = open(str(tmp_path / (name + ".log")), "w")
        logs.append((name, log.name))
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                      cwd=str(tmp_path)))
        return procs[-1]

    try:
        trainers = []
        for rank in range(2):
            t = svc["trainer-%d" % rank]
            cmd = list(t["command"])
            assert cmd[:2] == ["python3", "/opt/lightwire/examples/train_ddp.py"]
            cmd[:2] = [PYTHON, os.path.join(REPO, "clients", "python", "examples", "train_ddp.py")]
            cmd[cmd.index("--steps") + 1] = "40"
            cmd += ["--every", "20"]
            env = dict(os.environ)
            env.update({k: str(v) for k, v in t["environment"].items()})
            env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port)})
            env["LIGHTWIRE_SOCKET"] = str(tmp_path / ("node%d.sock" % rank))
            env["PYTHONPATH"] = os.path.join(REPO, "clients", "python")
            trainers.append(start(cmd, env, "trainer-%d" % rank))
        time.sleep(1.0)  # the trainers are waiting for sockets that do not exist yet
        for rank in range(2):
            s = svc["lightwire-%d" % rank]
            env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
            env.update({k: str(v) for k, v in s["environment"].items()})
            cmd = [LIGHTWIRE_BIN] + [c.replace("/etc/lightwire/lightwire.yaml", conf_path)
                                     for c in s["command"]]
            cmd += ["--peers", peers, "--peer-listen", "127.0.0.1:%d" % peer_ports[rank],
                    "--socket", str(tmp_path / ("node%d.sock" % rank)),
                    "--admin-listen", "127.0.0.1:0", "--state-dir", str(tmp_path / ("state%d" % rank)),
                    "--threads", "1"]
            start(cmd, env, "lightwire-%d" % rank)
        deadline = time.monotonic() + 240
        for t in trainers:
            while t.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
        outputs = {}
        for name, path in logs:
            with open(path, encoding="utf-8", errors="replace") as f:
                outputs[name] = f.read()
        for rank, t in enumerate(trainers):
            assert t.returncode == 0, "trainer-%d: %s\n%s" % (
                rank, t.returncode, outputs["trainer-%d" % rank][-3000:])
        out = outputs["trainer-0"]
        m = re.search(r"lightwire: final loss ([0-9.]+)\s+acc ([0-9.]+).* (\d+) fallbacks"
                      r"\s+compression ([0-9.]+)x", out)
        assert m, out[-3000:]
        assert int(m.group(3)) == 0, out[-3000:]
        assert float(m.group(4)) > 5, out[-3000:]  # dgc at density 0.01 (after its warm-up)
        # Per layer: the weights with dgc, the biases dense ("codec dgc 3 + none 3").
        assert re.search(r"codec dgc \d+ \+ none \d+", out), out[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


# ---------------------------------------------------------------- containers' CPU limits


def _cpu_cgroup(tmp_name):
    """A new cgroup with the cpu controller (v2 unified, else v1's cpu mount) and the file that
    sets its quota, or None where this machine does not let us make one."""
    for base, quota_file, value in (
            ("/sys/fs/cgroup", "cpu.max", "50000 100000"),
            ("/sys/fs/cgroup/cpu", "cpu.cfs_quota_us", "50000"),
            ("/sys/fs/cgroup/cpu,cpuacct", "cpu.cfs_quota_us", "50000")):
        if not os.path.exists(os.path.join(base, quota_file if base != "/sys/fs/cgroup"
                                           else "cgroup.subtree_control")):
            continue
        if base == "/sys/fs/cgroup":
            with open(os.path.join(base, "cgroup.subtree_control")) as f:
                if "cpu" not in f.read().split():
                    continue
        path = os.path.join(base, tmp_name)
        try:
            os.mkdir(path)
            with open(os.path.join(path, quota_file), "w") as f:
                f.write(value)
            return path, quota_file
        except OSError:
            try:
                os.rmdir(path)
            except OSError:
                pass
    return None


def test_threads_follow_the_cgroup_cpu_quota(tmp_path):
    """threads 0 in a container with a CPU limit: as many codec threads as the quota allows
    (here half a CPU: one thread), not one per CPU of the machine."""
    need_binary()
    cg = _cpu_cgroup("lightwire-test-%d" % os.getpid())
    if cg is None:
        pytest.skip("cannot create a cgroup with the cpu controller here (needs root)")
    path, quota_file = cg
    sock = str(tmp_path / "s.sock")
    log = str(tmp_path / "serve.log")
    try:
        with open(log, "w") as out:
            # The shell joins the cgroup, then becomes the sidecar: the quota applies from its start.
            proc = subprocess.Popen(
                ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', path, LIGHTWIRE_BIN,
                 "serve", "--socket", sock, "--control-tcp", "", "--admin-listen", "",
                 "--state-dir", ""], stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 20
            while not os.path.exists(sock):
                assert proc.poll() is None and time.monotonic() < deadline, open(log).read()
                time.sleep(0.05)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        text = open(log).read()
        assert "1 compute thread(s)" in text, text
        assert "cgroup quota 0.5 CPUs from %s" % os.path.join(path, quota_file) in text, text
    finally:
        for _ in range(50):
            try:
                os.rmdir(path)
                break
            except OSError:
                time.sleep(0.1)
