"""Settings: environment variables under ``SMR_``, optionally a TOML file.

Every setting is listed once in ``SETTINGS`` with its default and meaning;
``smr config`` prints them. Precedence: environment, then the file named by
``SMR_CONFIG`` (keys are the names without the prefix, lower-case), then the
default. Invalid values fail at start with the setting's name and the fix.
"""

from __future__ import annotations

import os
import shutil
import socket
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from smr.config_values import (
    aes_key,
    boolean,
    choice,
    count,
    eviction_hard_text,
    label_prefix,
    names,
    pairs,
    pos_float,
    pos_int,
    replicas,
    seconds,
    zstd_level,
)
from smr.contract.errors import ConfigError

PREFIX = "SMR_"
REPO_TOOLS = Path(__file__).resolve().parent.parent / ".tools" / "bin"


def _default_data_dir() -> str:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return str(Path(base) / "smr")


@dataclass(frozen=True)
class Setting:
    name: str
    default: Any
    parse: Callable[[str], Any]
    doc: str
    secret: bool = False  # never printed: `smr config` output ends up in issues and pod logs


SETTINGS: tuple[Setting, ...] = (
    Setting("NATS_URL", "", str, "NATS server URL, or a comma-separated list of a cluster's "
            "servers (the client reconnects to any of them); empty: `smr up` starts an "
            "embedded nats-server"),
    Setting("NATS_REPLICAS", 1, replicas, "replicas of every JetStream stream and KV bucket "
            "smr creates (1 to 5; 3 on a 3-server NATS cluster, 1 on a single server); an "
            "existing one is updated to it at start"),
    Setting("NATS_CREDS", "", str, "a NATS credentials file (.creds) for a NATS that "
            "requires one; empty: none"),
    Setting("NATS_USER", "", str, "the NATS user this service connects as (each service "
            "its own, with only the subjects it needs: deploy/kustomize/components/nats-auth); "
            "empty: none. Its replies come to _INBOX.<user>.>"),
    Setting("NATS_PASSWORD", "", str, "that user's password (from the Secret smr-nats-users "
            "in the cluster overlays)", secret=True),
    Setting("NATS_TOKEN_FILE", "", str, "node agent: a file holding its projected "
            "ServiceAccount token, presented to NATS as its token; the auth callout "
            "(`smr natsauth`) gives it a user held to its node's subjects; empty: none"),
    Setting("NATS_CALLOUT_SEED_FILE", "", str, "`smr natsauth`: the file of the issuer "
            "account's nkey seed (SA...) it signs agents' users with; its public key is "
            "the server's auth_callout issuer"),
    Setting("NATS_AGENT_TEMPLATE", "", str, "`smr natsauth`: agent-node.conf.template "
            "(components/nats-auth), the permissions it gives an agent for its node"),
    Setting("NATS_SETUP", True, boolean, "create or update smr's streams and KV buckets at "
            "start, and a node's own request consumers; false: wait for them (a NATS user "
            "that may not create them: in the cluster the storage service makes the streams, "
            "the watcher each node's consumers)"),
    Setting("NODE_NAME", "", str, "this node's name (subjects end in it); default: the host name"),
    Setting("DATA_DIR", "", str, "state, logs and local checkpoints; default: $XDG_DATA_HOME/smr"),
    Setting("JOB_KEY", "", str, "file of the key that signs local jobs' records (made by "
            "`smr up`, root-only); default: DATA_DIR/job.key; nodes sharing a NATS share it"),
    Setting("WORK_DIR", "", str, "where a local job's images are dumped on their way to storage; "
            "default: DATA_DIR/work; on a tmpfs a GPU heartbeat's freeze is shorter"),
    Setting("STEP_LOCK_DIR", "", str, "where each running step holds a lock the kernel lets "
            "go when its worker's process ends, so that no redelivery acts beside a live "
            "worker whose heartbeats do not get through; every worker of a node must share "
            "it (the agent's is a hostPath); default: DATA_DIR/steps (never under WORK_DIR, "
            "whose entries a request's id names)"),
    Setting("STORAGE", "local", choice("local", "s3"), "checkpoint storage backend"),
    Setting("STORAGE_PATH", "", str, "local backend's directory; default: DATA_DIR/checkpoints"),
    Setting("S3_BUCKET", "", str, "S3 bucket (SMR_STORAGE=s3); credentials: the AWS chain"),
    Setting("S3_PREFIX", "smr", str, "key prefix inside the bucket"),
    Setting("S3_ENDPOINT", "", str, "S3-compatible endpoint URL; empty: AWS"),
    Setting("S3_REGION", "", str, "S3 region; empty: the AWS chain's"),
    Setting("S3_PATH_STYLE", False, boolean, "path-style addressing (most non-AWS servers)"),
    Setting("ZSTD_LEVEL", 3, zstd_level, "zstd level of stored images; 0: none"),
    Setting("ENCRYPTION_KEY", "", aes_key,
            "base64 32-byte AES-256-GCM key; empty: images in clear. Set on a node that has "
            "clear checkpoints, it makes them unrestorable there: migrate as "
            "docs/security.md says (\"Turning encryption on\")", secret=True),
    Setting("ENCRYPTION_KEY_FILE", "", str, "file holding such keys, one per line (a mounted "
            "Secret): the first writes, the others still read (rotation); each namespace's "
            "data key is derived from them"),
    Setting("KEEP_GENERATIONS", 5, count, "generations kept per checkpoint_id; 0: all"),
    Setting("MAX_AGE", 0.0, seconds, "seconds a generation is kept (latest always); 0: forever"),
    Setting("GC_GRACE", 3600.0, seconds,
            "age after which an unfinished upload is garbage. A writer renews its claim every "
            "grace/4 of its own setting and records that interval in the claim; GC takes it for "
            "dead only once silent for the longer of its own grace and 4 renewals, so a storage "
            "Deployment set shorter than the nodes never aborts a live writer"),
    Setting("GC_INTERVAL", 600.0, pos_float, "seconds between garbage collections"),
    Setting("GPU", "auto", choice("auto", "off"), "checkpoint GPU state through the CUDA "
            "driver; auto: where the driver has the checkpoint API"),
    Setting("GPU_ALLOW", (), names, "refusals of smr's GPU gate lifted on this node "
            "(comma-separated): peer-access (a process on two GPUs or more), nccl-p2p (NCCL "
            "ranks with a transport on that maps a peer's memory: P2P, SHM or NVLS); driver 580 "
            "cannot restore either (docs/gpu.md)"),
    Setting("CUDA_LOCK_TIMEOUT", 10.0, pos_float, "seconds to wait for a job's GPU work to "
            "reach a lockable point"),
    Setting("KUBE_API", "", str, "Kubernetes API URL; empty: in-cluster, else "
            "~/.kube/config"),
    Setting("CHECKPOINT_RESOURCES", "off", choice("off", "on"), "the storage service keeps "
            "a Checkpoint resource (smr.dev) per stored checkpoint in its namespace, for "
            "`kubectl get checkpoints` (docs/kubernetes.md); needs the CRD and its RBAC"),
    Setting("KUBE_TOKEN_FILE", "", str, "bearer token file for SMR_KUBE_API (a service "
            "account's token); empty: none"),
    Setting("LABEL_PREFIX", "smr.dev", label_prefix, "prefix of the opt-in pod labels "
            "(<prefix>/node-restore, <prefix>/heartbeat-checkpoint); cedana.ai/ also works"),
    Setting("PREEMPTION_TAINTS", (), names, "extra taint keys (comma-separated) that mean "
            "a node is about to be taken away"),
    Setting("HEARTBEAT_MIN", 30.0, pos_float, "shortest heartbeat-checkpoint interval "
            "accepted, seconds"),
    Setting("HEARTBEAT_MAX", 604800.0, pos_float, "longest heartbeat-checkpoint interval "
            "accepted, seconds"),
    Setting("LEASE_NAMESPACE", "smr-system", str, "namespace of the watcher's leader Lease"),
    Setting("LEASE_NAME", "smr-watcher", str, "name of the watcher's leader Lease"),
    Setting("LEASE_DURATION", 15.0, pos_float, "seconds a leader Lease is valid unrenewed"),
    Setting("LEASE_RENEW_DEADLINE", 10.0, pos_float, "seconds a leader keeps trying to renew"),
    Setting("LEASE_RETRY", 2.0, pos_float, "seconds between Lease attempts (at least 1)"),
    Setting("PUBLISH_CONCURRENCY", 64, pos_int, "requests the watcher publishes at once"),
    Setting("CRIU", "", str, "criu binary; default: the one `make setup` installed, else PATH"),
    Setting("METRICS_PORT", 9464, count, "port of /metrics (Prometheus) for every "
            "long-running service and `smr up` (0: none)"),
    Setting("HEALTH_PORT", 8080, count, "cluster services: port of /livez and /readyz for "
            "the probes (0: none)"),
    Setting("INIT", "", str, "node agent: its own smr-init binary; default: `make setup`'s, "
            "else PATH (/usr/local/bin in the image)"),
    Setting("CRIU_ROOT", "", str, "node agent: the prefix CRIU is installed in, copied into "
            "pods (its usr/sbin/criu, usr/lib/x86_64-linux-gnu); default: `make setup`'s, else /"),
    Setting("CRIU_TIMEOUT", 600.0, pos_float, "seconds one CRIU dump or restore may take"),
    Setting("COMMIT_DEADLINE", 1800.0, pos_float, "seconds a finished dump is retried into "
            "storage that fails (a final checkpoint's job held stopped meanwhile) before the "
            "checkpoint fails and the job runs on"),
    Setting("LOCK_WAIT", 3600.0, pos_float, "seconds a checkpoint or restore waits for "
            "another live step on the same job before it is retried"),
    Setting("CHECKPOINTS_PER_NODE", 4, pos_int, "node agent: a leave-running checkpoint "
            "starts while fewer than this many checkpoints run on the node, a final one "
            "(drain, preemption, shutdown) while fewer than this many final ones do, before "
            "the leave-running ones waiting"),
    Setting("CHECKPOINT_SCRATCH", 0, count, "node agent: bytes of its work directory the "
            "dumps in flight may fill together (estimated from each workload's memory and "
            "its writable layer's and /dev/shm's data, or its last dump); 0: the free "
            "space there. A dump always starts when none runs"),
    Setting("KUBELET_EVICTION_HARD", "nodefs.available<10%,imagefs.available<15%",
            eviction_hard_text, "node agent: the kubelet's hard eviction thresholds for disk "
            "space, in its --eviction-hard form (default: the kubelet's own); a dump never takes "
            "the work directory's file system below the largest of them (the node would get "
            "DiskPressure and its pods evicted with no grace): over it, the checkpoint fails "
            "with eviction-threshold and the workload runs on"),
    Setting("CAPTURE_BYTES", 16 << 30, count, "node agent: bytes a pod checkpoint's copies "
            "of its container's writable layer and /dev/shm may take together in its work "
            "directory where the container sets no ephemeral-storage limit (holes in sparse "
            "files take none); over it, the checkpoint fails with capture-too-large and the "
            "workload runs on"),
    Setting("RESTORES_PER_NODE", 4, pos_int, "restores of different jobs or containers a "
            "node runs at once"),
    Setting("TEMPLATE_CACHE_BYTES", 50 << 30, count, "node agent: bytes of warm-start "
            "template objects kept in its work directory, so that replicas of one template "
            "on a node download each object once (docs/warm-start.md); 0: no cache"),
    Setting("TEMPLATE_PREPULL", (), names, "node agent: warm-start templates "
            "(comma-separated `namespace/name`, as in the label smr.dev/start-from) it reads "
            "into its template cache as soon as storage holds them, and again when one is "
            "taken anew, before any replica starts (as an image pre-pull): a replica then "
            "restores from the node's disk (docs/warm-start.md)"),
    Setting("RUNTIME_INSTALL", "off", choice("off", "files", "restart", "uninstall"),
            "node agent: install smr-runtime and containerd's smr runtime handlers on the node "
            "at start (files), and restart containerd if they changed (restart); uninstall: "
            "remove them and restart containerd. In every mode it then labels the node "
            "runtime.smr.dev/<handler>=true for each handler there (none after an "
            "uninstall): the labels the smr RuntimeClasses schedule on"),
    Setting("AGENT_WAIT", 600, count, "node agent: how long after its last sign of life a "
            "container starting on its node still waits for an agent (one being replaced in a "
            "DaemonSet rollout, or restarting) before smr-init gives up and applies the "
            "pod's restore-failure policy (docs/kubernetes.md, \"Upgrading smr\"); written "
            "into smr-runtime.env. 0: smr-init's own SMR_INIT_TIMEOUT only"),
    Setting("AGENT_MARK", "", str, "node agent: the file it touches every few seconds while "
            "it runs, whose age smr-runtime reads (AGENT_WAIT); default: "
            "HOST_ROOT/var/lib/smr/bin/agent-alive (beside smr-runtime; an uninstall "
            "removes it) when it installs smr-runtime, else none"),
    Setting("HOST_ROOT", "/proc/1/root", str, "node agent: the node's root file system "
            "(it shares the host's PID namespace)"),
    Setting("RUNTIME_BINARY", "", str, "node agent: its own smr-runtime; default: `make "
            "setup`'s, else PATH (/usr/local/bin in the image)"),
    Setting("RUNTIME_CLASS", "smr", str, "webhook: the RuntimeClass given to opted-in pods "
            "(its handler runs smr-runtime in front of runc)"),
    Setting("RUNTIME_CLASS_MAP", {"nvidia": "smr-nvidia"}, pairs, "webhook: a pod's own "
            "RuntimeClass → the smr class that wraps the same runtime (NAME=SMR_NAME,...)"),
    Setting("FINAL_CHECKPOINT_SECONDS", 60, count, "webhook: the least seconds added to an "
            "opted-in pod's terminationGracePeriodSeconds for its final checkpoint, which its "
            "preStop hook waits for before the kubelet's SIGTERM; more for a workload whose "
            "last checkpoint took longer (twice its measured time, plus 10 s). 0: no hook"),
    Setting("RESTORE_SECONDS", 600, count, "webhook: how long the startupProbe it adds to "
            "an opted-in container with a liveness probe waits for its workload to run "
            "(a restore), before the kubelet gives up on it"),
    Setting("MAX_GRACE_SECONDS", 600, count, "webhook: the longest "
            "terminationGracePeriodSeconds it sets; a pod's annotation "
            "smr.dev/max-grace-seconds lowers it"),
    Setting("WEBHOOK_PORT", 8443, count, "webhook: HTTPS port (0: any free one)"),
    Setting("WEBHOOK_SERVICE", "smr-webhook", str, "webhook: its Service (the names its "
            "certificate is for)"),
    Setting("WEBHOOK_NAMESPACE", "smr-system", str, "webhook: its namespace and its Secret's"),
    Setting("WEBHOOK_SECRET", "smr-webhook-tls", str, "webhook: the Secret holding its CA, "
            "certificate and key (created and renewed by the webhook)"),
    Setting("WEBHOOK_CONFIG", "smr-webhook", str, "webhook: the "
            "MutatingWebhookConfiguration whose caBundle it keeps current"),
    Setting("WEBHOOK_CERT_DIR", "", str, "webhook: read tls.crt/tls.key from here (cert-manager) "
            "instead of managing the Secret; empty: self-managed"),
    Setting("NATS_SERVER", "", str, "nats-server binary for the embedded mode"),
    Setting("MAX_DELIVER", 5, pos_int, "deliveries of one request before it is dead-lettered"),
    Setting("ACK_WAIT", 30.0, pos_float, "seconds before an un-acked request is redelivered"),
    Setting("DEDUPE_WINDOW", 3600.0, pos_float, "seconds JetStream remembers a request_id"),
)



@dataclass(frozen=True)
class ReadElsewhere:
    """An environment variable read outside ``load``: by another program or
    library, or per container. Listed so docs/configuration.md names them all."""

    name: str
    read_by: str
    doc: str


ELSEWHERE: tuple[ReadElsewhere, ...] = (
    ReadElsewhere("SMR_CONFIG", "every smr program (smr/config.py)", "a TOML file of the "
                  "settings above (keys: their names without SMR_, lower-case); the "
                  "environment wins over it"),
    ReadElsewhere("SMR_CHECKPOINT", "the watcher and the webhook, on a pod's container",
                  "opt-in: every start of that container resumes from this checkpoint id's "
                  "latest generation (CEDANA_CHECKPOINT is read the same way)"),
    ReadElsewhere("SMR_CONTAINER", "smr-runtime and smr-init, in the container", "the "
                  "container's name: set by the webhook on opted-in containers (by hand in a "
                  "hand-written manifest); smr-runtime wraps only containers that have it"),
    ReadElsewhere("SMR_INIT_DIR", "smr-init, in the container", "smr-init's state "
                  "directory; default /smr. The node agent ignores it and reads /smr only "
                  "(smr-runtime's tmpfs or the manifest's volume): a pod that moves it gets no "
                  "answer, and smr-init's own timeout applies"),
    ReadElsewhere("SMR_INIT_TIMEOUT", "smr-init, in the container", "seconds smr-init waits "
                  "for the agent's restore-or-start answer before it starts the command "
                  "fresh (or, with SMR_RESTORE_FAILURE=fail, exits 70); default 30"),
    ReadElsewhere("SMR_RESTORE_FAILURE", "smr-init, in the container", "`fail`: no fresh "
                  "start when no agent answers within SMR_INIT_TIMEOUT either (exit 70; the "
                  "container's restart asks again). Set by the webhook on pods labelled "
                  "restore-failure: fail (by hand in a hand-written manifest)"),
    ReadElsewhere("SMR_IO_URING", "smr-init and smr.process.reaper, in a job's or container's "
                  "environment", "`allow`: the workload keeps io_uring; otherwise "
                  "io_uring_setup fails with ENOSYS in its whole tree (libuv then uses epoll), "
                  "since CRIU cannot save an io_uring (docs/gpu.md)"),
    ReadElsewhere("RUNTIME", "smr-runtime, from smr-runtime.env beside it (written by the "
                  "agent)", "the real OCI runtime it hands every call to: the host's runc, "
                  "or the NVIDIA runtime for smr-nvidia"),
    ReadElsewhere("INIT", "smr-runtime, from smr-runtime.env", "the host's smr-init it "
                  "mounts into containers; default: beside smr-runtime"),
    ReadElsewhere("STATE", "smr-runtime, from smr-runtime.env", "where each "
                  "container's /smr tmpfs is mounted on the host; default /run/smr/containers"),
    ReadElsewhere("SIZE", "smr-runtime, from smr-runtime.env", "the size of each "
                  "container's /smr tmpfs (tmpfs's size=, e.g. 4m); default 4m. Charged to the "
                  "container's memory cgroup as it writes"),
    ReadElsewhere("LOG", "smr-runtime, from smr-runtime.env", "a file it appends its log "
                  "to; default: stderr (containerd's log)"),
    ReadElsewhere("AGENT_MARK", "smr-runtime, from smr-runtime.env", "the file the node "
                  "agent touches while it runs (SMR_AGENT_MARK); unset: no agent is waited for"),
    ReadElsewhere("AGENT_WAIT", "smr-runtime, from smr-runtime.env", "SMR_AGENT_WAIT, as "
                  "the agent wrote it; default 0"),
    ReadElsewhere("SMR_INIT_AGENT_WAIT", "smr-init, in the container (set by smr-runtime)",
                  "seconds smr-init waits for an agent when the node's agent ran just before "
                  "the container was created (being replaced, or restarting): what is left "
                  "of SMR_AGENT_WAIT since its last sign of life. Longer than "
                  "SMR_INIT_TIMEOUT, it replaces it"),
    ReadElsewhere("OTEL_EXPORTER_OTLP_ENDPOINT", "every smr service (smr/tracing.py)",
                  "OTLP/HTTP collector; set: traces are exported (docs/observability.md)"),
    ReadElsewhere("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "smr/tracing.py", "the same, for "
                  "traces only"),
    ReadElsewhere("OTEL_TRACES_EXPORTER", "smr/tracing.py", "`otlp`: export even without an "
                  "endpoint (the SDK's default one); `none`: never"),
    ReadElsewhere("OTEL_SERVICE_NAME", "smr/tracing.py", "the traces' service.name; default "
                  "smr-<service>"),
    ReadElsewhere("KUBERNETES_SERVICE_HOST", "the watcher, agent and webhook "
                  "(services/kubeapi.py)", "set by Kubernetes in every pod: with "
                  "SMR_KUBE_API empty, the in-cluster API is used"),
    ReadElsewhere("XDG_DATA_HOME", "smr/config.py", "the default SMR_DATA_DIR is "
                  "$XDG_DATA_HOME/smr (else ~/.local/share/smr)"),
    ReadElsewhere("SMR_TOOLS", "`make setup` (scripts/install-tools.sh)", "where CRIU, "
                  "nats-server and kustomize are unpacked; default: the checkout's .tools"),
    ReadElsewhere("SMR_DEBIAN_MIRROR", "`make setup` (scripts/install-tools.sh)", "the Debian "
                  "mirror CRIU, nats-server and kustomize are downloaded from; default: "
                  "http://deb.debian.org/debian"),
)


def _find_binary(explicit: str, name: str, setting: str) -> str:
    if explicit:
        return explicit
    local = REPO_TOOLS / name
    if local.exists():
        return str(local)
    found = shutil.which(name)
    if found:
        return found
    raise ConfigError(
        f"{name} not found", code="binary-missing",
        hint=f"run `make setup`, or set {PREFIX}{setting} to the {name} binary",
    )


@dataclass(frozen=True)
class Settings:
    values: Mapping[str, Any] = field(default_factory=dict)

    def __getattr__(self, item: str) -> Any:
        try:
            return self.values[item.upper()]
        except KeyError:
            raise AttributeError(item) from None

    @property
    def node(self) -> str:
        return self.values["NODE_NAME"] or socket.gethostname().split(".")[0]

    @property
    def data_path(self) -> Path:
        return Path(self.values["DATA_DIR"] or _default_data_dir())

    @property
    def job_key_path(self) -> Path:
        return Path(self.values["JOB_KEY"] or self.data_path / "job.key")

    @property
    def work_path(self) -> Path:
        return Path(self.values["WORK_DIR"] or self.data_path / "work")

    @property
    def hold_path(self) -> Path:
        """Where a GPU tree held across an agent's crash is described. A dot
        name: a local step's work directory is WORK_DIR/<request_id>, emptied as
        it starts, and no request_id starts with a dot (schemas/common.json)."""
        return self.work_path / ".held"

    @property
    def agent_mark_path(self) -> Path | None:
        if self.values["AGENT_MARK"]:
            return Path(self.values["AGENT_MARK"])
        if self.values["RUNTIME_INSTALL"] in ("files", "restart"):
            return Path(self.values["HOST_ROOT"]) / "var/lib/smr/bin/agent-alive"
        return None

    @property
    def step_lock_path(self) -> Path:
        # Not WORK_DIR/steps: WORK_DIR/<request_id> is a step's work directory,
        # emptied as it starts, and "steps" is a request_id like any other.
        return Path(self.values["STEP_LOCK_DIR"] or self.data_path / "steps")

    @property
    def storage_root(self) -> Path:
        return Path(self.values["STORAGE_PATH"] or self.data_path / "checkpoints")

    def criu_binary(self) -> str:
        return _find_binary(self.values["CRIU"], "criu", "CRIU")

    def criu_preload(self) -> str:
        """criu-limits.so (native/criu-limits.c) where `make setup` or the smr
        image put it, or "" (CRIU then needs CAP_SYS_RESOURCE to dump a task
        of another user)."""
        return _native("criu-limits.so")

    def criu_root_switch(self) -> str:
        """criu-root.so (native/criu-root.c), which the node agent's CRIU
        needs to take a container's root as `/` once its own files are
        loaded; "" where neither `make setup` nor the smr image put it."""
        return _native("criu-root.so")

    def init_binary(self) -> str:
        return _find_binary(self.values["INIT"], "smr-init", "INIT")

    def runtime_binary(self) -> str:
        return _find_binary(self.values["RUNTIME_BINARY"], "smr-runtime", "RUNTIME_BINARY")

    def criu_root(self) -> Path:
        if self.values["CRIU_ROOT"]:
            return Path(self.values["CRIU_ROOT"])
        local = REPO_TOOLS.parent / "root"
        return local if (local / "usr/sbin/criu").is_file() else Path("/")

    def nats_server_binary(self) -> str:
        return _find_binary(self.values["NATS_SERVER"], "nats-server", "NATS_SERVER")

    def replace(self, **kw: Any) -> Settings:
        return Settings({**self.values, **{k.upper(): v for k, v in kw.items()}})


def _native(name: str) -> str:
    """A library of native/ where `make setup` or the smr image put it, or ""."""
    for where in (REPO_TOOLS.parent / "lib", Path("/usr/lib/smr")):
        if (where / name).is_file():
            return str(where / name)
    return ""


def load(env: Mapping[str, str] | None = None) -> Settings:
    env = os.environ if env is None else env
    from_file: dict[str, Any] = {}
    if path := env.get(PREFIX + "CONFIG"):
        try:
            from_file = {k.upper(): v for k, v in tomllib.loads(Path(path).read_text()).items()}
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(
                f"cannot read {PREFIX}CONFIG={path}: {e}", hint="point it at a readable TOML file"
            ) from None
        unknown = set(from_file) - {s.name for s in SETTINGS}
        if unknown:
            raise ConfigError(
                f"unknown setting(s) in {path}: {', '.join(sorted(unknown)).lower()}",
                hint="`smr config` lists the settings",
            )
    values: dict[str, Any] = {}
    for s in SETTINGS:
        raw = env.get(PREFIX + s.name)
        src = f"{PREFIX}{s.name}"
        if raw is None and s.name in from_file:
            raw, src = str(from_file[s.name]), f"{s.name.lower()} in {env.get(PREFIX + 'CONFIG')}"
        if raw is None:
            values[s.name] = s.default
            continue
        try:
            values[s.name] = s.parse(raw)
        except ValueError as e:
            shown = "(a secret, not shown)" if s.secret else repr(raw)
            raise ConfigError(
                f"invalid {src}={shown}: {e}", hint=f"{PREFIX}{s.name} is the {s.doc}"
            ) from None
    if values["STORAGE"] == "s3" and not values["S3_BUCKET"]:
        raise ConfigError(f"{PREFIX}STORAGE=s3 needs a bucket", hint=f"set {PREFIX}S3_BUCKET")
    return Settings(values)
