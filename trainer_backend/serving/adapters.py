"""LoRA adapters published into a running vLLM server, by served name, without a full reload.

vLLM's own way, ``POST /v1/load_lora_adapter`` with ``load_inplace: true``, has two faults
(vllm 0.32, found with the real server): the request it stores for the name keeps
``load_inplace``, so *every engine step* reloads the adapter from that folder (a step costs a
disk read; deleting an old checkpoint makes the name's requests fail with 500), and a request
queued while the engine was paused carries the previous version's request, so when it runs it
loads the previous version back into the slot: it is answered with the old weights under the
new version's tag, and so is every request batched with it.

So each name is registered once, not in place, from a folder this publisher owns
(``<served_root>/<name>``, kept equal to the newest published version), and later versions
change the weights under the name's vLLM id through the worker extension, in two phases:

1. before the pause: ``GET /v1/models`` (is the name still registered from our folder? anyone
   else's load of it sends it back through registration) and ``lightning_stage_adapter``: the
   worker reads and checks the new adapter while serving; a bad adapter fails here, nothing
   paused;
2. in the pause: ``lightning_commit_adapters`` puts the staged weights in their slots (then the
   publisher tags the version and resumes);
3. after resuming: the name's folder is brought up to the new version (vLLM reads it again only
   if its LRU cache evicts the adapter).

The ids are recorded beside the folders (``ids.json``, with the worker's instance), so a new
publisher of the same folders (the trainer, after the run's start registered the names; a
restarted trainer) commits under them too. Registering a served name again would give it a new
id while requests accepted before carry the old one: more adapters in flight than the server has
slots, which killed vLLM's engine (a ``KeyError`` in its LoRA mapping) in the team demo.

The prefix cache must be empty when the new weights serve: block hashes include the adapter's
name and folder, which stay the same from version to version. vLLM's ``/pause`` clears it once
the in-flight requests have drained, and nothing runs until the resume (the publisher's `_swap`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

log = logging.getLogger(__name__)

Rpc = Callable[[httpx.Client, str, dict[str, Any]], dict[str, Any]]
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
IDS_FILE = "ids.json"  # in the served root: {"instance": the worker's, "ids": {name: vLLM LoRA id}}


class AdapterError(RuntimeError):
    """An adapter could not be staged, registered or committed."""


@dataclass(frozen=True)
class AdapterPlan:
    """One publish: the adapters to commit under known ids, and those to (re)register."""

    root: Path  # the names' own folders are root/<name>
    staged: tuple[tuple[str, Path, int], ...]  # (name, version folder, vLLM LoRA id)
    register: tuple[tuple[str, Path], ...]  # (name, version folder)
    served: dict[str, str]  # the adapters the API server had before: name -> folder
    stage_s: float


class AdapterSlots:
    """The served names' vLLM ids and folders, for one publisher and one server."""

    def __init__(self, server_url: str, rpc: Rpc, served_root: Path | None = None) -> None:
        self.server_url = server_url
        self.rpc = rpc
        self.served_root = served_root
        self.ids: dict[str, int] = {}
        self.instance: str | None = None  # the worker's, learned at a registration

    def prepare(self, c: httpx.Client, ckpt: Path, adapters: list[tuple[str, Path]]) -> AdapterPlan:
        """Stage every adapter whose name we registered and still own; the rest register. The
        names' folders are in `served_root`, by default `served-adapters/` beside the checkpoint."""
        root = self.served_root or ckpt.parent / "served-adapters"
        served = self._served_roots(c)
        if any(name not in self.ids for name, _ in adapters):
            self._adopt(c, root)
        staged, register, stage_s = [], [], 0.0
        for name, path in adapters:
            lora_id = self.ids.get(name)
            if lora_id is None or served.get(name) != str(root / name):
                register.append((name, path))
                continue
            info = self._call(c, "lightning_stage_adapter", {"lora_int_id": lora_id, "path": str(path)}, name)
            stage_s += info["stage_s"]
            staged.append((name, path, lora_id))
        return AdapterPlan(root, tuple(staged), tuple(register), served, stage_s)

    def apply(self, c: httpx.Client, plan: AdapterPlan) -> float:
        """In the pause: commit the staged adapters, register the others. Returns the worker's commit s."""
        commit_s = 0.0
        if plan.staged:
            info = self._call(c, "lightning_commit_adapters", {"lora_int_ids": [i for _, _, i in plan.staged]},
                              ", ".join(n for n, _, _ in plan.staged))
            commit_s = info["commit_s"]
        for name, path in plan.register:
            self._register(c, name, path, plan)
        return commit_s

    def refresh(self, plan: AdapterPlan) -> None:
        """After resuming: the names' folders hold the versions just committed, and the record
        holds the ids of the names just registered (written here, out of the pause)."""
        for name, path, _ in plan.staged:
            _copy_adapter(path, plan.root / name)
        if plan.register and self.instance is not None:
            self._record(plan.root, self.instance, [name for name, _ in plan.register])

    def _register(self, c: httpx.Client, name: str, path: Path, plan: AdapterPlan) -> None:
        """Load `name` from our folder as a new adapter (not in place) and learn its id."""
        if name in plan.served:
            _ok(c.post(f"{self.server_url}/v1/unload_lora_adapter", json={"lora_name": name}))
        folder = plan.root / name
        _copy_adapter(path, folder)
        worker = self._call(c, "lightning_adapter_ids", {}, name)
        _ok(c.post(f"{self.server_url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(folder)}))
        new = set(self._call(c, "lightning_adapter_ids", {}, name)["ids"]) - set(worker["ids"])
        if len(new) != 1:
            raise AdapterError(f"could not tell which LoRA id vLLM gave {name!r} (new ids: {sorted(new)})")
        self.ids[name] = new.pop()
        self.instance = worker["instance"]

    def _adopt(self, c: httpx.Client, root: Path) -> None:
        """Take the ids recorded in `root` by an earlier publisher of its folders, if they are this
        server instance's (a restarted server gives new ids)."""
        instance, ids = _read_ids(root / IDS_FILE)
        if ids and instance == self._call(c, "lightning_adapter_ids", {}, str(root))["instance"]:
            for name, lora_id in ids.items():
                self.ids.setdefault(name, lora_id)

    def _record(self, root: Path, instance: str, names: list[str]) -> None:
        """Add the names' ids to `root`'s record (replaced atomically; another instance's ids are dropped)."""
        recorded, ids = _read_ids(root / IDS_FILE)
        ids = {**(ids if recorded == instance else {}), **{name: self.ids[name] for name in names}}
        tmp = root / f".{IDS_FILE}.tmp"
        tmp.write_text(json.dumps({"instance": instance, "ids": ids}, indent=1))
        os.replace(tmp, root / IDS_FILE)

    def _served_roots(self, c: httpx.Client) -> dict[str, str]:
        """Served adapter name -> the folder the API server loads it from."""
        models = _ok(c.get(f"{self.server_url}/v1/models")).json()["data"]
        return {m["id"]: m["root"] for m in models if m.get("parent") and m["id"] != m.get("parent")}

    def _call(self, c: httpx.Client, method: str, kwargs: dict[str, Any], what: str) -> dict[str, Any]:
        info = self.rpc(c, method, kwargs)
        if "error" in info:
            raise AdapterError(f"{method} for {what}: {info['error']}")
        return info


def _read_ids(path: Path) -> tuple[str | None, dict[str, int]]:
    """(worker instance, name -> id) recorded in `path`; nothing if it is missing or malformed."""
    try:
        recorded = json.loads(path.read_text())
        return str(recorded["instance"]), {str(k): int(v) for k, v in recorded["ids"].items()}
    except FileNotFoundError:
        return None, {}
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        log.warning("ignoring %s (%s): its adapters are registered again", path, exc)
        return None, {}


def _copy_adapter(src: Path, dst: Path) -> None:
    """Copy the adapter's files into `dst`, each replaced atomically (a reader never sees half a file)."""
    dst.mkdir(parents=True, exist_ok=True)
    for name in ADAPTER_FILES:
        tmp = dst / f".{name}.tmp"
        shutil.copyfile(src / name, tmp)
        os.replace(tmp, dst / name)


def _ok(resp: httpx.Response) -> httpx.Response:
    if resp.status_code >= 400:
        raise AdapterError(f"{resp.request.method} {resp.request.url} -> {resp.status_code}: {resp.text[:500]}")
    return resp
