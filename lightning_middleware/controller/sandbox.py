"""The sandbox for rollouts that run what the model wrote: one `Sandbox` record, rendered into a
Kubernetes pod (backends/k8s_template.py) and enforced locally with bubblewrap
(backends/sandboxed.py).

Why bubblewrap: it is Debian's maintained, unprivileged sandbox (Flatpak's), a single binary that
puts a command in new user, mount, network, PID, IPC and UTS namespaces with an explicit file
system, so what a rollout sees is what we bind, not what we remember to hide. nsjail does as
much but is not packaged by Debian 12 and wants a config language; a container runtime needs a
daemon. Limits bubblewrap does not set come from `prlimit` (util-linux: address space and CPU
time) and the cgroup `pids` controller (process count; RLIMIT_NPROC is not enforced for root).

What a sandboxed rollout sees, locally:
- network: its own namespace, loopback only; one Unix socket bound in leads to the rollout's door,
  which passes that rollout's routes to the gateway and nothing else (backends/sandboxed.py);
- files: a read-only root of the system directories and the Python it runs, one writable work
  directory of its own at `workspace_path`, removed after the rollout; the store, other rollouts'
  directories and `hidden_paths` are not there;
- environment: only the variables `env_allow` names, plus those the backend sets;
- limits: `memory_bytes` of address space, `cpu_s` of CPU time, `max_procs` processes, and the
  rollout's timeout as wall time.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_middleware.controller.sandbox_entry import DOOR_PATH, under  # DOOR_PATH: the door's socket, inside
from lightning_middleware.errors import UsageError

DEFAULT_ENV_ALLOW = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "PYTHONHASHSEED", "PYTHONUNBUFFERED",
                     "PYTHONDONTWRITEBYTECODE")
SANDBOX_UID = 65534  # "nobody" inside the sandbox's user namespace
# Run by its path, not as a module: it imports nothing of this package, so a sandboxed rollout
# starts in a bare interpreter's time instead of after the package's imports (0.4 s here).
ENTRY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_entry.py")
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64")
_ETC_FILES = ("/etc/ssl", "/etc/ca-certificates", "/etc/localtime", "/etc/passwd", "/etc/group", "/etc/hosts",
              "/etc/nsswitch.conf", "/etc/alternatives", "/etc/ld.so.cache", "/etc/mime.types")


@dataclass(frozen=True)
class Sandbox:
    """What a rollout that runs model-written code may not do; one policy for both places it runs.

    Field by field (docs/reliability.md has the table):
    - `egress_to`: Kubernetes NetworkPolicy peers the pod may reach, plus DNS (None: no policy).
      Locally the network is always the rollout's own loopback plus its door to the gateway.
    - `read_only_root_fs`: the image's (locally: the system's) files cannot be changed.
    - `automount_service_account_token`: False keeps the Kubernetes API token out of the pod; locally
      there is no token to mount.
    - `run_as_non_root`: the pod's processes may not run as UID 0; locally they are always UID 65534
      in their own user namespace.
    - `workspace_volume` / `workspace_path`: the work directory (a pod volume; locally a fresh
      directory per rollout, a copy of `workspace_from` when given, removed after the rollout).
    - `hide_git`: the repository's history is not visible (an empty `.git`; locally `.git` is not
      copied) and `GIT_DIR` points nowhere.
    - `env_allow`: the only variables passed on from the controller's environment (locally; a pod's
      environment is the template's `env`, nothing is inherited).
    - `memory_bytes`: a pod's memory limit; locally the address-space limit (RLIMIT_AS).
    - `cpu_s`: CPU seconds (RLIMIT_CPU) locally; a pod has no CPU-time limit (its deadline bounds it).
    - `max_procs`: processes and threads (the cgroup pids controller) locally; on Kubernetes it is
      the kubelet's podPidsLimit, a node setting, not a pod field.
    - `hidden_paths`: host paths masked inside (checkpoints, caches) even where a bound directory
      contains them; the store's file is always masked.
    """

    egress_to: tuple[dict[str, Any], ...] | None = ()
    read_only_root_fs: bool = True
    automount_service_account_token: bool = False
    run_as_non_root: bool = False
    workspace_volume: dict[str, Any] | None = None  # a pod volume source, e.g. {"persistentVolumeClaim": {...}}
    workspace_path: str = "/workspace"
    hide_git: bool = True
    workspace_from: str | None = None  # locally: a directory copied into each rollout's work directory
    env_allow: tuple[str, ...] = DEFAULT_ENV_ALLOW
    memory_bytes: int | None = 2 * 2**30
    cpu_s: int | None = 300
    max_procs: int | None = 64
    hidden_paths: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.workspace_path.startswith("/") or self.workspace_path.rstrip("/") in ("", "/usr", "/run"):
            raise ValueError(f"workspace_path must be an absolute path of its own, got {self.workspace_path!r}")
        for name in ("memory_bytes", "cpu_s", "max_procs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"sandbox {name} must be a positive whole number or None, got {value!r}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Sandbox:
        """From a TOML/JSON table; lists become tuples, unknown keys are an error that names them."""
        data = dict(data)
        unknown = sorted(set(data) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"unknown sandbox keys {unknown}; known: {sorted(cls.__dataclass_fields__)}")
        for key in ("egress_to", "env_allow", "hidden_paths"):
            if data.get(key) is not None:
                data[key] = tuple(data[key])
        return cls(**data)


def load_sandbox(path: str) -> Sandbox:
    """Sandbox settings from a TOML file (a `[sandbox]` table, or the whole file) or a JSON object;
    a UsageError that names the file and the bad key."""
    import json

    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    try:
        text = Path(path).read_text(encoding="utf-8")
        data = json.loads(text) if path.endswith(".json") else tomllib.loads(text)
        table = data.get("sandbox", data) if isinstance(data, dict) else data
        if not isinstance(table, dict):
            raise ValueError("expected a table of sandbox settings")
        return Sandbox.from_dict(table)
    except (OSError, ValueError, TypeError) as exc:  # tomllib's and json's decode errors are ValueErrors
        raise UsageError(f"sandbox settings {path}: {exc}") from None


class SandboxUnavailable(UsageError, RuntimeError):
    """This host cannot enforce the sandbox; never run without it."""


@functools.lru_cache(maxsize=1)
def check_host() -> str:
    """The bwrap binary, after proving it can make the namespaces the sandbox needs; a one-line
    SandboxUnavailable naming the fix otherwise."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable("the sandbox needs bubblewrap: install the Debian package 'bubblewrap' "
                                 "(apt-get install bubblewrap)")
    if shutil.which("prlimit") is None:
        raise SandboxUnavailable("the sandbox needs prlimit: install the Debian package 'util-linux'")
    probe = [bwrap, "--unshare-all", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--ro-bind", "/", "/",
             "--proc", "/proc", "--dev", "/dev", "true"]
    done = subprocess.run(probe, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise SandboxUnavailable(f"this kernel refuses the sandbox's namespaces (user, network, mount, PID): "
                                 f"bwrap says {why!r}; enable unprivileged user namespaces "
                                 "(sysctl kernel.unprivileged_userns_clone=1) or run the controller where they are")
    return bwrap


# -- the command ---------------------------------------------------------------------------------


def _under(path: str, roots: Iterable[str]) -> bool:
    return any(under(path, r) for r in roots)


def read_only_paths(python: str, python_path: Sequence[str]) -> list[str]:
    """The host directories a sandboxed Python needs: its installation, its environment's, and the
    import path (an editable install's source tree, the agent's own package)."""
    wanted = [sys.base_prefix, sys.base_exec_prefix, sys.prefix, sys.exec_prefix,
              str(Path(python).parent.parent), *python_path]
    out: list[str] = []
    for p in sorted({os.path.realpath(p) for p in wanted if p and os.path.isdir(p)}, key=len):
        if not _under(p, out) and not _under(p, ("/usr",)):
            out.append(p)
    return out


def bwrap_command(sb: Sandbox, *, bwrap: str, workspace_dir: str, door_socket: str, python: str,
                  python_path: Sequence[str], env: Mapping[str, str], masked: Iterable[str] = (),
                  blind_file: str = "/dev/null",
                  argv: Sequence[str] = (ENTRY,)) -> list[str]:
    """The bwrap command line that runs `python argv` in `sb` (see the module docstring). A masked
    directory shows as an empty tmpfs, a masked file as `blind_file` (an unreadable empty file)."""
    cmd = [bwrap, "--unshare-all", "--die-with-parent", "--new-session",
           "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--clearenv"]
    for key, value in sorted(env.items()):
        cmd += ["--setenv", key, value]
    for d in _SYSTEM_DIRS:
        if os.path.islink(d):
            cmd += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            cmd += ["--ro-bind", d, d]
    for f in _ETC_FILES:
        cmd += ["--ro-bind-try", f, f]
    bound = read_only_paths(python, [*python_path, os.path.dirname(ENTRY)])
    for d in bound:
        cmd += ["--ro-bind", d, d]
    for p in sorted({os.path.realpath(m) for m in masked}):
        if not _under(p, [*bound, "/usr", "/etc"]) or not os.path.exists(p):
            continue  # not visible in the first place
        cmd += ["--tmpfs", p] if os.path.isdir(p) else ["--ro-bind", blind_file, p]
    cmd += ["--proc", "/proc", "--dev", "/dev",
            "--bind", workspace_dir, sb.workspace_path,
            "--tmpfs", "/run", "--dir", os.path.dirname(DOOR_PATH), "--bind", door_socket, DOOR_PATH,
            "--remount-ro", "/run", "--chdir", sb.workspace_path]
    if sb.read_only_root_fs:
        cmd += ["--remount-ro", "/"]
    return [*cmd, python, *argv]


def limits_prefix(sb: Sandbox) -> list[str]:
    """prlimit's part: address space and CPU time, set on bwrap and so inherited by all inside."""
    out = ["prlimit"]
    if sb.memory_bytes is not None:
        out.append(f"--as={sb.memory_bytes}")
    if sb.cpu_s is not None:
        out.append(f"--cpu={sb.cpu_s}")
    if sb.max_procs is not None and os.getuid() != 0:  # not enforced for root: the cgroup does it then
        out.append(f"--nproc={sb.max_procs}")
    return [*out, "--"]


class PidsCgroup:
    """A cgroup (v1 `pids` hierarchy, or v2 with the controller enabled) that caps one rollout's
    processes; None from `create` where this host has no writable one."""

    V1 = "/sys/fs/cgroup/pids"
    V2 = "/sys/fs/cgroup"

    def __init__(self, path: str) -> None:
        self.path = path

    @classmethod
    def root(cls) -> str | None:
        for base in (cls.V1, cls.V2):
            procs = os.path.join(base, "cgroup.procs")
            pids = base == cls.V1 or "pids" in _read(os.path.join(base, "cgroup.subtree_control"))
            if pids and os.path.isfile(procs) and os.access(base, os.W_OK):
                return os.path.join(base, "lightning-sandbox")
        return None

    @classmethod
    def create(cls, name: str, max_procs: int) -> PidsCgroup | None:
        root = cls.root()
        if root is None:
            return None
        path = os.path.join(root, name)
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "pids.max"), "w") as f:
            f.write(str(max_procs))
        return cls(path)

    def enter_command(self, cmd: Sequence[str]) -> list[str]:
        """`cmd`, started from inside this cgroup (the shell moves itself in, then execs)."""
        return ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', self.path, *cmd]

    def remove(self) -> None:
        for pid in _read(os.path.join(self.path, "cgroup.procs")).split():
            try:
                os.kill(int(pid), 9)
            except (ProcessLookupError, ValueError):
                pass
        for _ in range(50):
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:  # still emptying
                time.sleep(0.02)


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def pids_limit_available() -> bool:
    """Can `max_procs` be enforced here: a writable pids cgroup, or a non-root controller."""
    return os.getuid() != 0 or PidsCgroup.root() is not None
