#!/usr/bin/env python3
"""Checks deploy/pytorchjob.yaml and deploy/Containerfile without a cluster or a runtime.

The manifest is checked for the fields Kubeflow's training operator (kubeflow.org/v1,
release 1.9) reads: its defaulting (pkg/apis/kubeflow.org/v1/pytorch_defaults.go), its
admission checks (pkg/webhooks/pytorch/pytorchjob_webhook.go), the CRD's types
(manifests/base/crds/kubeflow.org_pytorchjobs.yaml) and the variables it derives for each
pod (pkg/controller.v1/pytorch/{envvar,elastic,master}.go), plus what hddp needs: the
command is the image's entry script, the trainer is one the build installs, --save-dir is
on a volume every pod shares. The Containerfile cannot be built here (no container
runtime): every path it COPYs from the repository must exist, its CMake options must be
the project's, and its torch pin must be scripts/setup.sh's.

A checker that cannot fail proves nothing: the run ends with a self-check that feeds the
checker mutated copies (a wrong field each) and requires each to be reported by name.

Also imported by pytorchjob_entry_test.py for operator_env() and the Containerfile's
entry-script path.

Usage: pytorchjob_manifest_test.py [--repo DIR] [--trainer NAME=PATH]...
  --trainer: run that trainer with the manifest's arguments (paths on the shared volume
  moved to a temporary folder, one step) to show it accepts them.
Exit: 0 when all checks pass, 1 with one line per problem otherwise.
"""
import argparse
import copy
import glob
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time

try:
    import yaml
except ImportError:  # pragma: no cover - a setup problem, said plainly
    sys.exit("pytorchjob_manifest_test: PyYAML is missing; scripts/setup.sh installs it "
             "into the project's Python (pip install pyyaml)")

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
MANIFEST = os.path.join("deploy", "pytorchjob.yaml")
CONTAINERFILE = os.path.join("deploy", "Containerfile")
ENTRY_SCRIPT = os.path.join("deploy", "entrypoint.sh")

# The operator's constants (pytorch_types.go).
DEFAULT_CONTAINER = "pytorch"
DEFAULT_PORT_NAME = "pytorchjob-port"
DEFAULT_PORT = 23456
REPLICA_TYPES = ("Master", "Worker")
RESTART_POLICIES = ("Always", "OnFailure", "Never", "ExitCode")
RDZV_BACKENDS = ("c10d", "etcd", "etcd-v2")
GPU = "nvidia.com/gpu"
DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def is_int(v):
    return type(v) is int  # bool is not an int here, as in the CRD's schema


# ---------------------------------------------------------------------------------------
# The operator's view: defaults and the variables each pod gets.

def apply_defaults(job):
    """A copy of job with the operator's defaults (SetDefaults_PyTorchJob)."""
    job = copy.deepcopy(job)
    spec = job.setdefault("spec", {})
    specs = spec.get("pytorchReplicaSpecs") or {}
    for rspec in specs.values():
        rspec.setdefault("replicas", 1)
        rspec.setdefault("restartPolicy", "OnFailure")
        for c in rspec.get("template", {}).get("spec", {}).get("containers", []) or []:
            if c.get("name") == DEFAULT_CONTAINER:
                ports = c.setdefault("ports", [])
                if not any(p.get("name") == DEFAULT_PORT_NAME for p in ports):
                    ports.append({"name": DEFAULT_PORT_NAME, "containerPort": DEFAULT_PORT})
    ep = spec.get("elasticPolicy")
    if ep is not None:
        if ep.get("maxReplicas") is None and ep.get("minReplicas") is not None:
            ep["maxReplicas"] = ep["minReplicas"]
        elif ep.get("minReplicas") is None and ep.get("maxReplicas") is not None:
            ep["minReplicas"] = ep["maxReplicas"]
        elif ep.get("minReplicas") is None and "Worker" in specs:
            ep["minReplicas"] = ep["maxReplicas"] = specs["Worker"]["replicas"]
    if ep is None or ep.get("nProcPerNode") is None:
        spec.setdefault("nprocPerNode", "auto")
    return job


def pytorch_port(rspec):
    for c in rspec["template"]["spec"]["containers"]:
        if c.get("name") == DEFAULT_CONTAINER:
            for p in c.get("ports", []):
                if p.get("name") == DEFAULT_PORT_NAME:
                    return p["containerPort"]
    raise ValueError("no port named %s in container %s" % (DEFAULT_PORT_NAME, DEFAULT_CONTAINER))


def operator_env(job, rtype="Worker", index=0):
    """The variables the operator adds to the container of pod `index` of `rtype`
    (setPodEnv in envvar.go, with elastic.go's and master.go's generators), in their
    order; a later one of the same name wins, as in Kubernetes."""
    job = apply_defaults(job)
    name = job["metadata"]["name"]
    spec = job["spec"]
    specs = spec["pytorchReplicaSpecs"]
    env = [("PYTHONUNBUFFERED", "1")]
    total = sum(r["replicas"] for r in specs.values())
    nproc = spec.get("nprocPerNode")
    nproc_int = int(nproc) if nproc is not None and str(nproc).isdigit() else 1
    if "Master" in specs:
        port = str(pytorch_port(specs["Master"]))
        addr = "%s-master-0" % name
        env += [("MASTER_PORT", port), ("PET_MASTER_PORT", port),
                ("MASTER_ADDR", addr), ("PET_MASTER_ADDR", addr)]
        rank = index + (1 if rtype == "Worker" else 0)
        env += [("WORLD_SIZE", str(total * nproc_int)), ("RANK", str(rank)),
                ("PET_NODE_RANK", str(rank))]
    if nproc is not None:
        env.append(("PET_NPROC_PER_NODE", str(nproc)))
    ep = spec.get("elasticPolicy")
    if ep is not None:
        host = ep.get("rdzvHost") or "%s-worker-0" % name
        port = ep.get("rdzvPort") or pytorch_port(specs["Worker"])
        env.append(("PET_RDZV_ENDPOINT", "%s:%s" % (host, port)))
        env.append(("PET_RDZV_BACKEND", ep.get("rdzvBackend") or "c10d"))
        if ep.get("minReplicas") is None and ep.get("maxReplicas") is None:
            env.append(("PET_NNODES", str(specs["Worker"]["replicas"])))
        else:
            env.append(("PET_NNODES", "%d:%d" % (ep["minReplicas"], ep["maxReplicas"])))
        if ep.get("maxRestarts") is not None:
            env.append(("PET_MAX_RESTARTS", str(ep["maxRestarts"])))
        if ep.get("nProcPerNode") is not None:
            env.append(("PET_NPROC_PER_NODE", str(ep["nProcPerNode"])))
        if ep.get("rdzvId") is not None:
            env.append(("PET_RDZV_ID", ep["rdzvId"]))
        if ep.get("rdzvConf"):
            env.append(("PET_RDZV_CONF",
                        ",".join("%s=%s" % (c.get("key", ""), c.get("value", ""))
                                 for c in ep["rdzvConf"])))
        if ep.get("standalone"):
            env.append(("PET_STANDALONE", ""))
    else:
        env.append(("PET_NNODES", str(total)))
    return dict(env)


# ---------------------------------------------------------------------------------------
# The Containerfile.

def containerfile_instructions(text):
    """(KEYWORD, argument text) per instruction, continuation lines joined."""
    out, cur = [], ""
    for line in text.splitlines():
        s = line.strip()
        if not cur and (not s or s.startswith("#")):
            continue
        if cur and s.startswith("#"):
            continue  # a comment inside a continued instruction
        if s.endswith("\\"):
            cur += s[:-1] + " "
            continue
        cur += s
        word, _, rest = cur.partition(" ")
        out.append((word.upper(), rest.strip()))
        cur = ""
    return out


def containerfile_copies(text):
    """[(sources, destination, from_stage)] of every COPY/ADD."""
    copies = []
    for word, rest in containerfile_instructions(text):
        if word not in ("COPY", "ADD"):
            continue
        if rest.startswith("["):
            parts = json.loads(rest)
            flags = []
        else:
            parts = shlex.split(rest)
            flags = [p for p in parts if p.startswith("--")]
            parts = [p for p in parts if not p.startswith("--")]
        stage = None
        for f in flags:
            if f.startswith("--from="):
                stage = f.split("=", 1)[1]
        copies.append((parts[:-1], parts[-1], stage))
    return copies


def containerfile_entrypoint(text):
    for word, rest in reversed(containerfile_instructions(text)):
        if word == "ENTRYPOINT":
            return json.loads(rest) if rest.startswith("[") else shlex.split(rest)
    return None


def entry_path_in_image(text):
    """Where the Containerfile puts deploy/entrypoint.sh (None if it does not)."""
    for sources, dest, stage in containerfile_copies(text):
        if stage is None and sources == [ENTRY_SCRIPT]:
            return dest
    return None


def check_containerfile(text, repo):
    problems = []
    for sources, dest, stage in containerfile_copies(text):
        if stage is not None:
            continue
        for src in sources:
            if not glob.glob(os.path.join(repo, src)):
                problems.append("Containerfile: COPY source %s does not exist in the repository" % src)
    entry = entry_path_in_image(text)
    if entry is None:
        problems.append("Containerfile: no COPY of %s into the image" % ENTRY_SCRIPT)
    ep = containerfile_entrypoint(text)
    if entry is not None and ep != [entry]:
        problems.append("Containerfile: ENTRYPOINT %s is not the entry script %s" % (ep, entry))
    # Its -D options are the project's.
    declared = set()
    for path in [os.path.join(repo, "CMakeLists.txt")] + glob.glob(os.path.join(repo, "cmake", "*.cmake")):
        with open(path) as f:
            src = f.read()
        declared.update(re.findall(r"option\(\s*(\w+)", src))
        declared.update(re.findall(r"set\(\s*(\w+)\s[^)]*\bCACHE\b", src))
    for opt in sorted(set(re.findall(r"-D(HDDP_\w+)=", text))):
        if opt not in declared:
            problems.append("Containerfile: -D%s is not an option of CMakeLists.txt or cmake/" % opt)
    # The torch pin is the project's (scripts/setup.sh).
    with open(os.path.join(repo, "scripts", "setup.sh")) as f:
        pin = re.search(r"HDDP_TORCH_VERSION:-([0-9.]+)", f.read())
    arg = re.search(r"^ARG TORCH_VERSION=(\S+)", text, re.M)
    if not pin or not arg or arg.group(1) != pin.group(1):
        problems.append("Containerfile: ARG TORCH_VERSION=%s is not scripts/setup.sh's torch %s"
                        % (arg and arg.group(1), pin and pin.group(1)))
    return problems


# ---------------------------------------------------------------------------------------
# The manifest.

def installed_programs(repo):
    """Programs the build installs into bin/ (install(TARGETS NAME ... RUNTIME ...))."""
    names = set()
    for path in glob.glob(os.path.join(repo, "examples", "*", "CMakeLists.txt")) + \
            glob.glob(os.path.join(repo, "tools", "*", "CMakeLists.txt")):
        with open(path) as f:
            names.update(re.findall(r"install\(\s*TARGETS\s+([\w-]+)", f.read()))
    return names


def option_value(args, name):
    """The value of --name in a list of arguments (--name=V or --name V), else None."""
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def check_job(docs, containerfile_text, repo, notes=None):
    """Problems of the PyTorchJob in docs (a list of YAML documents); each names its field.
    Warnings the operator gives (not errors) go to notes when given."""
    problems = []
    jobs = [d for d in docs if isinstance(d, dict) and d.get("kind") == "PyTorchJob"]
    if len(jobs) != 1:
        return ["kind: want one PyTorchJob in the file, found %d" % len(jobs)]
    job = jobs[0]
    p = problems.append
    if job.get("apiVersion") != "kubeflow.org/v1":
        p("apiVersion: %r, want kubeflow.org/v1" % job.get("apiVersion"))
    name = (job.get("metadata") or {}).get("name")
    if not isinstance(name, str) or not DNS1035.match(name) or len(name) > 63:
        p("metadata.name: %r is not a DNS-1035 label (the webhook rejects it)" % name)
    spec = job.get("spec") or {}
    specs = spec.get("pytorchReplicaSpecs")
    if not isinstance(specs, dict) or not specs:
        return problems + ["spec.pytorchReplicaSpecs: missing"]
    for rtype in specs:
        if rtype not in REPLICA_TYPES:
            p("spec.pytorchReplicaSpecs.%s: not a replica type (%s)" % (rtype, ", ".join(REPLICA_TYPES)))
    worker = specs.get("Worker")
    if worker is None:
        return problems + ["spec.pytorchReplicaSpecs.Worker: missing (an elastic job needs it)"]
    wpath = "spec.pytorchReplicaSpecs.Worker"
    replicas = worker.get("replicas", 1)
    if not is_int(replicas) or replicas < 1:
        p("%s.replicas: %r, want an integer >= 1" % (wpath, replicas))
        replicas = None
    if "Master" in specs and specs["Master"].get("replicas", 1) != 1:
        p("spec.pytorchReplicaSpecs.Master.replicas: must be 1")
    rp = worker.get("restartPolicy")
    if rp not in RESTART_POLICIES:
        p("%s.restartPolicy: %r, want one of %s" % (wpath, rp, ", ".join(RESTART_POLICIES)))
    elif rp == "Never":
        p("%s.restartPolicy: Never: a failed pod never comes back, so the job cannot grow back; "
          "want OnFailure" % wpath)

    # The elastic policy.
    ep = spec.get("elasticPolicy")
    gpus = None
    if not isinstance(ep, dict):
        p("spec.elasticPolicy: missing (hddp's manifest is an elastic job)")
        ep = {}
    epath = "spec.elasticPolicy"
    for key in ("minReplicas", "maxReplicas", "maxRestarts", "nProcPerNode", "rdzvPort"):
        if key in ep and not is_int(ep[key]):
            p("%s.%s: %r is not an integer (the CRD says int32)" % (epath, key, ep[key]))
    lo, hi = ep.get("minReplicas"), ep.get("maxReplicas")
    if not (is_int(lo) and is_int(hi)):
        p("%s.minReplicas/maxReplicas: both wanted (PET_NNODES=MIN:MAX)" % epath)
    else:
        if lo < 1:
            p("%s.minReplicas: %d, want >= 1" % (epath, lo))
        if lo > hi:
            p("%s.minReplicas: %d is above maxReplicas %d" % (epath, lo, hi))
        if replicas is not None and replicas < lo:
            p("%s.replicas: %d pods can never reach minReplicas %d" % (wpath, replicas, lo))
        if replicas is not None and hi > replicas and not ep.get("metrics"):
            p("%s.maxReplicas: %d is above the %d Worker replicas and no metrics can scale them: "
              "every rendezvous would wait for pods that never come" % (epath, hi, replicas))
    if ep.get("rdzvBackend") not in RDZV_BACKENDS:
        p("%s.rdzvBackend: %r, want one of %s" % (epath, ep.get("rdzvBackend"), ", ".join(RDZV_BACKENDS)))
    if "maxRestarts" in ep and is_int(ep["maxRestarts"]) and ep["maxRestarts"] < 0:
        p("%s.maxRestarts: %d, want >= 0" % (epath, ep["maxRestarts"]))
    nproc = spec.get("nprocPerNode")
    if ep.get("nProcPerNode") is not None and nproc is not None:
        p("%s.nProcPerNode: must not be used with spec.nprocPerNode (the webhook forbids both)" % epath)
    if nproc is not None and not isinstance(nproc, str):
        p("spec.nprocPerNode: %r is not a string (the CRD says string, e.g. \"1\")" % (nproc,))
    if ep.get("nProcPerNode") is not None and notes is not None:
        notes.append("%s.nProcPerNode is deprecated since v1.7; spec.nprocPerNode replaces it" % epath)
    nproc_value = str(ep["nProcPerNode"]) if ep.get("nProcPerNode") is not None else nproc
    if nproc_value is None:
        p("spec.nprocPerNode: missing; the operator's default \"auto\" starts one rank per CPU "
          "core on a pod without GPUs")
    elif not (re.fullmatch(r"[1-9][0-9]*", str(nproc_value)) or nproc_value in ("auto", "gpu", "cpu")):
        p("spec.nprocPerNode: %r is not a positive number, auto, gpu or cpu" % (nproc_value,))

    # The container.
    tspec = (worker.get("template") or {}).get("spec") or {}
    containers = tspec.get("containers") or []
    cpath = wpath + ".template.spec.containers"
    named = [c for c in containers if c.get("name") == DEFAULT_CONTAINER]
    if not named:
        return problems + ["%s[0].name: no container named %r (the operator requires one and "
                           "takes the rendezvous port from it)" % (cpath, DEFAULT_CONTAINER)]
    c = named[0]
    cpath = "%s[%d]" % (cpath, containers.index(c))
    if not isinstance(c.get("image"), str) or not c["image"]:
        p("%s.image: missing" % cpath)
    entry = entry_path_in_image(containerfile_text)
    command = c.get("command")
    if not (isinstance(command, list) and command and command[0] == entry):
        p("%s.command: %r, want the image's entry script [%s] (deploy/Containerfile copies "
          "%s there)" % (cpath, command, entry, ENTRY_SCRIPT))
    args = c.get("args") or []
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        p("%s.args: want a list of strings" % cpath)
        args = []
    if args and not args[0].startswith("-") and args[0] not in installed_programs(repo):
        p("%s.args[0]: trainer %r is not a program the build installs into bin/" % (cpath, args[0]))
    for port in c.get("ports") or []:
        if port.get("name") == DEFAULT_PORT_NAME and not is_int(port.get("containerPort")):
            p("%s.ports[%s].containerPort: want an integer (the rendezvous port)" % (cpath, DEFAULT_PORT_NAME))
    limits = (c.get("resources") or {}).get("limits") or {}
    gpus = limits.get(GPU)
    if not is_int(gpus) or gpus < 1:
        p("%s.resources.limits[%s]: %r, want an integer >= 1 (a rank per GPU)" % (cpath, GPU, gpus))
    elif re.fullmatch(r"[0-9]+", str(nproc_value or "")) and int(nproc_value) != gpus:
        p("spec.nprocPerNode: %s ranks per pod, but each pod has %d GPU(s)" % (nproc_value, gpus))

    # --save-dir on a volume every pod shares.
    save_dir = option_value(args, "--save-dir")
    if not save_dir:
        p("%s.args: no --save-dir (restarts resume from it)" % cpath)
    else:
        mounts = [m for m in c.get("volumeMounts") or []
                  if save_dir == m.get("mountPath") or save_dir.startswith(m.get("mountPath", "").rstrip("/") + "/")]
        if not mounts:
            p("%s.volumeMounts: --save-dir %s is on no mounted volume" % (cpath, save_dir))
        else:
            mount = max(mounts, key=lambda m: len(m["mountPath"]))
            vols = {v.get("name"): v for v in tspec.get("volumes") or []}
            vol = vols.get(mount.get("name"))
            claim = ((vol or {}).get("persistentVolumeClaim") or {}).get("claimName")
            if not claim:
                p("%s.template.spec.volumes[%s]: --save-dir's volume is not a persistentVolumeClaim "
                  "(the pods need one shared folder)" % (wpath, mount.get("name")))
            else:
                pvcs = [d for d in docs if isinstance(d, dict) and d.get("kind") == "PersistentVolumeClaim"
                        and (d.get("metadata") or {}).get("name") == claim]
                modes = (pvcs[0].get("spec") or {}).get("accessModes") or [] if pvcs else None
                if modes is not None and "ReadWriteMany" not in modes:
                    p("PersistentVolumeClaim %s: spec.accessModes %s lacks ReadWriteMany (pods on "
                      "several nodes mount it)" % (claim, modes))
    return problems


def check_files(manifest_path, containerfile_path, repo, notes=None):
    with open(manifest_path) as f:
        docs = list(yaml.safe_load_all(f))
    with open(containerfile_path) as f:
        cf = f.read()
    problems = check_containerfile(cf, repo) + check_job(docs, cf, repo, notes)
    entry = os.path.join(repo, ENTRY_SCRIPT)
    if not os.access(entry, os.X_OK):
        problems.append("%s: not executable" % ENTRY_SCRIPT)
    elif subprocess.run(["bash", "-n", entry]).returncode != 0:
        problems.append("%s: bash -n fails" % ENTRY_SCRIPT)
    return problems


# ---------------------------------------------------------------------------------------
# The self-check: each mutation must be reported, by the field it breaks.

def job_of(docs):
    return next(d for d in docs if isinstance(d, dict) and d.get("kind") == "PyTorchJob")


def container_of(docs):
    return job_of(docs)["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]


def _set(path, value):
    def mutate(docs):
        obj = job_of(docs)
        for key in path[:-1]:
            obj = obj[key]
        obj[path[-1]] = value
    return mutate


def _del(path):
    def mutate(docs):
        obj = job_of(docs)
        for key in path[:-1]:
            obj = obj[key]
        del obj[path[-1]]
    return mutate


def _container(key, value):
    def mutate(docs):
        container_of(docs)[key] = value
    return mutate


def _no_mounts(docs):
    container_of(docs)["volumeMounts"] = []


def _pvc_rwo(docs):
    for d in docs:
        if isinstance(d, dict) and d.get("kind") == "PersistentVolumeClaim":
            d["spec"]["accessModes"] = ["ReadWriteOnce"]


MUTATIONS = [
    ("apiVersion v1beta1", _set(["apiVersion"], "kubeflow.org/v1beta1"), "apiVersion"),
    ("container renamed", _container("name", "trainer"), "containers[0].name"),
    ("minReplicas above maxReplicas", _set(["spec", "elasticPolicy", "minReplicas"], 5), "elasticPolicy.minReplicas"),
    ("maxReplicas a string", _set(["spec", "elasticPolicy", "maxReplicas"], "2"), "elasticPolicy.maxReplicas"),
    ("maxReplicas above the Worker replicas", _set(["spec", "elasticPolicy", "maxReplicas"], 4), "elasticPolicy.maxReplicas"),
    ("rdzvBackend misspelt", _set(["spec", "elasticPolicy", "rdzvBackend"], "c10"), "elasticPolicy.rdzvBackend"),
    ("maxRestarts negative", _set(["spec", "elasticPolicy", "maxRestarts"], -1), "elasticPolicy.maxRestarts"),
    ("nProcPerNode in both places", _set(["spec", "elasticPolicy", "nProcPerNode"], 1), "elasticPolicy.nProcPerNode"),
    ("nprocPerNode a number", _set(["spec", "nprocPerNode"], 1), "spec.nprocPerNode"),
    ("no elasticPolicy", _del(["spec", "elasticPolicy"]), "spec.elasticPolicy"),
    ("restartPolicy Never", _set(["spec", "pytorchReplicaSpecs", "Worker", "restartPolicy"], "Never"), "Worker.restartPolicy"),
    ("no GPU", _container("resources", {}), "resources.limits[nvidia.com/gpu]"),
    ("command not the entry script", _container("command", ["torchrun"]), "containers[0].command"),
    ("unknown trainer", _container("args", ["train_nothing", "--save-dir=/shared/x"]), "args[0]"),
    ("no --save-dir", _container("args", ["train_resnet"]), "no --save-dir"),
    ("--save-dir not mounted", _no_mounts, "volumeMounts"),
    ("claim not ReadWriteMany", _pvc_rwo, "ReadWriteMany"),
]


def self_check(manifest_path, containerfile_path, repo, tmp):
    """[failure lines]: mutations the checker missed, and Containerfile ones too."""
    failures = []
    with open(manifest_path) as f:
        original = list(yaml.safe_load_all(f))
    for what, mutate, field in MUTATIONS:
        docs = copy.deepcopy(original)
        mutate(docs)
        path = os.path.join(tmp, "mutated.yaml")
        with open(path, "w") as f:
            yaml.safe_dump_all(docs, f, sort_keys=False)
        found = check_files(path, containerfile_path, repo)
        if not any(field in line for line in found):
            failures.append("self-check: %s: the checker did not report %s (it said: %s)"
                            % (what, field, found or "nothing"))
    with open(containerfile_path) as f:
        cf = f.read()
    for what, text, field in [
        ("a COPY of a missing folder", cf + "\nCOPY no_such_dir/ /x/\n", "no_such_dir/"),
        ("the entry script copied elsewhere", cf.replace("/opt/hddp/bin/hddp-entrypoint", "/entry.sh"), "command"),
        ("an option the project lacks", cf.replace("-DHDDP_BUILD_BENCH=OFF", "-DHDDP_BUILD_BENCHES=OFF"), "HDDP_BUILD_BENCHES"),
        ("another torch", re.sub(r"ARG TORCH_VERSION=\S+", "ARG TORCH_VERSION=2.10.0", cf), "TORCH_VERSION"),
    ]:
        path = os.path.join(tmp, "Containerfile.mutated")
        with open(path, "w") as f:
            f.write(text)
        found = check_files(manifest_path, path, repo)
        if not any(field in line for line in found):
            failures.append("self-check: Containerfile with %s: not reported (it said: %s)"
                            % (what, found or "nothing"))
    return failures, len(MUTATIONS) + 4


# ---------------------------------------------------------------------------------------
# The trainer takes the manifest's arguments.

def run_trainer(manifest_path, trainers, tmp):
    with open(manifest_path) as f:
        docs = list(yaml.safe_load_all(f))
    c = container_of(docs)
    args = list(c.get("args") or [])
    name = "train_resnet"
    if args and not args[0].startswith("-"):
        name = args.pop(0)
    if name not in trainers:
        return ["trainer %s: no --trainer %s=PATH given, cannot run it" % (name, name)]
    mounts = [m["mountPath"].rstrip("/") for m in c.get("volumeMounts") or []]
    shared = os.path.join(tmp, "shared")

    def moved(a):
        for m in mounts:
            a = a.replace(m + "/", shared + "/").replace("=" + m, "=" + shared)
        return a
    args = [moved(a) for a in args]
    # One step on a few samples, on the CPU; the data is Debian's Fashion-MNIST, which
    # scripts/setup.sh installs and the image has.
    extra = ["--max-steps=1", "--limit-train=1024", "--limit-test=64", "--workers=0",
             "--threads=1", "--progress=off"]
    env = dict(os.environ, HDDP_DEVICE="cpu", HDDP_LOG_LEVEL="warn")
    start = time.monotonic()
    r = subprocess.run([trainers[name]] + args + extra, env=env, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=240)
    print("%s with the manifest's args (+ %s): exit %d in %.1f s"
          % (name, " ".join(extra), r.returncode, time.monotonic() - start))
    if r.returncode != 0:
        return ["trainer %s rejects or fails on the manifest's args %s (exit %d):\n%s"
                % (name, args, r.returncode, r.stdout[-3000:])]
    save_dir = option_value(args, "--save-dir")
    if save_dir and not (os.path.isdir(save_dir) and os.listdir(save_dir)):
        return ["trainer %s wrote nothing into --save-dir %s" % (name, save_dir)]
    return []


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repo", default=REPO)
    ap.add_argument("--trainer", action="append", default=[], metavar="NAME=PATH")
    opts = ap.parse_args()
    repo = os.path.abspath(opts.repo)
    manifest = os.path.join(repo, MANIFEST)
    containerfile = os.path.join(repo, CONTAINERFILE)
    trainers = dict(t.split("=", 1) for t in opts.trainer)

    notes = []
    problems = check_files(manifest, containerfile, repo, notes)
    for line in notes:
        print("note: " + line)
    with open(manifest) as f:
        job = job_of(list(yaml.safe_load_all(f)))
    env = operator_env(job, "Worker", 0)
    print("the operator's variables for pod Worker-0: " +
          " ".join("%s=%s" % kv for kv in sorted(env.items())))
    with tempfile.TemporaryDirectory(prefix="hddp-pytorchjob-") as tmp:
        failures, n = self_check(manifest, containerfile, repo, tmp)
        problems += failures
        print("self-check: %d of %d mutated copies reported by the field they break" % (n - len(failures), n))
        if trainers:
            problems += run_trainer(manifest, trainers, tmp)
    for line in problems:
        print("FAIL: " + line)
    print("pytorchjob_manifest_test: %s" % ("FAILED" if problems else "OK"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
