"""An emulated Kubernetes API server: the REST endpoints the Kubernetes backend and `reap` use, over
real HTTP, so the official client talks to it exactly as it would to a cluster.

    with K8sAPIServer() as api:            # plus a Kubelet(api) to run the Jobs' pods
        cfg = kubernetes.client.Configuration(host=api.url)

What it serves (any resource, core `/api/v1` or `/apis/<group>/<version>`, namespaced): create (409
when the name exists), get, list and watch with label selectors and resourceVersions (a watch from
an expired version answers 410 Gone, as etcd compaction would), merge-patch, delete and delete
collection, with `propagationPolicy` (a Job's pods are deleted with it unless orphaned, which is the
API's default for Jobs) and pod logs. Not served: authentication, admission, field selectors,
strategic-merge semantics beyond a JSON merge. kmock's KubernetesEmulator was tried first; its
0.8 release has no label selectors, resource versions or pod logs, which the backend relies on.
"""

from __future__ import annotations

import asyncio
import bisect
import copy
import json
import re
import threading
import time
import uuid
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from aiohttp import web

Key = tuple[str, str, str]  # (plural, namespace, name)
Listener = Callable[[str, str, dict[str, Any]], None]  # (event type, plural, object)
_PATH = re.compile(r"^/(?:api/v1|apis/(?P<group>[^/]+)/[^/]+)/namespaces/(?P<ns>[^/]+)/(?P<plural>[^/]+)"
                   r"(?:/(?P<name>[^/]+))?(?:/(?P<sub>[^/]+))?$")
_ALL_NS = re.compile(r"^/(?:api/v1|apis/[^/]+/[^/]+)/(?P<plural>[^/]+)$")
_HISTORY = 5000  # watch events kept; older resourceVersions are "compacted" (410 Gone)


def now_iso() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _status(code: int, reason: str, message: str) -> web.Response:
    body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}
    return web.json_response(body, status=code)


def _selector_matches(selector: str | None, labels: dict[str, str]) -> bool:
    """Equality (=, ==, !=), set (in, notin) and existence (key, !key) requirements, all ANDed."""
    if not selector:
        return True
    for req in re.split(r",(?![^(]*\))", selector):
        req = req.strip()
        if m := re.fullmatch(r"(\S+)\s+(in|notin)\s+\(([^)]*)\)", req):
            values = {v.strip() for v in m.group(3).split(",")}
            inside = labels.get(m.group(1)) in values
            if inside != (m.group(2) == "in"):
                return False
        elif "!=" in req:
            k, v = req.split("!=", 1)
            if labels.get(k.strip()) == v.strip():
                return False
        elif "=" in req:
            k, v = req.replace("==", "=").split("=", 1)
            if labels.get(k.strip()) != v.strip():
                return False
        elif req.startswith("!"):
            if req[1:] in labels:
                return False
        elif req not in labels:
            return False
    return True


def merge_patch(target: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """RFC 7386 JSON merge patch."""
    for k, v in patch.items():
        if v is None:
            target.pop(k, None)
        elif isinstance(v, dict) and isinstance(target.get(k), dict):
            merge_patch(target[k], v)
        else:
            target[k] = copy.deepcopy(v)
    return target


class ObjectStore:
    """The API server's state: objects, a resourceVersion counter, the event history for watches.
    Touched only from the server's event loop (the kubelet runs there too)."""

    def __init__(self) -> None:
        self.objects: dict[Key, dict[str, Any]] = {}
        self.rv = 0
        self.history: list[tuple[int, str, str, dict[str, Any]]] = []  # (rv, type, plural, object)
        self.logs: dict[tuple[str, str], list[str]] = {}  # (namespace, pod) -> lines
        self.listeners: list[Listener] = []
        self.changed = asyncio.Condition()
        self.requests: dict[str, int] = {}  # "VERB plural" -> count, for assertions and the benchmark

    def _emit(self, kind: str, plural: str, obj: dict[str, Any]) -> None:
        self.history.append((int(obj["metadata"]["resourceVersion"]), kind, plural, copy.deepcopy(obj)))
        del self.history[:-_HISTORY]
        for listener in list(self.listeners):
            listener(kind, plural, obj)
        asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    def _bump(self, obj: dict[str, Any]) -> None:
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)

    def create(self, plural: str, namespace: str, obj: dict[str, Any]) -> dict[str, Any]:
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        key = (plural, namespace, meta.get("name") or "")
        if not key[2]:
            raise ValueError("metadata.name is required")
        if key in self.objects:
            raise KeyError(key[2])
        meta.update(namespace=namespace, uid=str(uuid.uuid4()), creationTimestamp=now_iso(), generation=1)
        obj.setdefault("status", {})
        self._bump(obj)
        self.objects[key] = obj
        self._emit("ADDED", plural, obj)
        return obj

    def patch(self, plural: str, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        obj = self.objects[(plural, namespace, name)]
        merge_patch(obj, patch)
        self._bump(obj)
        self._emit("MODIFIED", plural, obj)
        return obj

    def delete(self, plural: str, namespace: str, name: str, propagation: str | None = None) -> dict[str, Any]:
        obj = self.objects.pop((plural, namespace, name))
        self._bump(obj)
        self._emit("DELETED", plural, obj)
        policy = propagation or ("Orphan" if plural == "jobs" else "Background")
        if policy != "Orphan":  # the garbage collector: dependents go with their owner
            uid = obj["metadata"]["uid"]
            for key, dep in list(self.objects.items()):
                owners = dep["metadata"].get("ownerReferences") or []
                if key[1] == namespace and any(o.get("uid") == uid for o in owners):
                    self.delete(key[0], key[1], key[2], policy)
        return obj

    def select(self, plural: str, namespace: str | None, selector: str | None) -> list[dict[str, Any]]:
        return [o for (p, ns, _), o in self.objects.items()
                if p == plural and (namespace is None or ns == namespace)
                and _selector_matches(selector, o["metadata"].get("labels") or {})]


class K8sAPIServer:
    """The emulated API server on 127.0.0.1 in a background thread (its own event loop)."""

    def __init__(self, port: int = 0) -> None:
        self.port = port
        self.loop = asyncio.new_event_loop()
        self.store: ObjectStore | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._ready = threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> K8sAPIServer:
        self.start()
        return self

    def __exit__(self, *_exc: Any) -> None:
        self.stop()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._serve, daemon=True, name="k8s-api")
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the emulated Kubernetes API server did not start")

    def call(self, fn: Callable[[], Any], timeout: float = 10.0) -> Any:
        """Run fn() on the server's loop (objects are only touched there) and return its result."""
        async def _run() -> Any:
            return fn()
        return asyncio.run_coroutine_threadsafe(_run(), self.loop).result(timeout)

    def objects(self, plural: str, selector: str | None = None) -> list[dict[str, Any]]:
        assert self.store is not None
        store = self.store
        return self.call(lambda: copy.deepcopy(store.select(plural, None, selector)))

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.store = ObjectStore()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=1.0)
        self.loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self._ready.set()
        self.loop.run_forever()

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        if self._thread is not None:
            self._thread.join(10)

    # -- HTTP ------------------------------------------------------------------------
    async def _handle(self, request: web.Request) -> web.StreamResponse:
        assert self.store is not None
        path = request.path
        if path in ("/version", "/version/"):
            return web.json_response({"major": "1", "minor": "31", "gitVersion": "v1.31.0-lightning-emulator"})
        m = _PATH.match(path)
        if m is None and (m2 := _ALL_NS.match(path)) and request.method == "GET":
            return await self._list_or_watch(request, m2.group("plural"), None)
        if m is None:
            return _status(404, "NotFound", f"the emulator does not serve {request.method} {path}")
        plural, ns, name, sub = m.group("plural"), m.group("ns"), m.group("name"), m.group("sub")
        verb = request.method
        self.store.requests[f"{verb} {plural}"] = self.store.requests.get(f"{verb} {plural}", 0) + 1
        if sub == "log" and plural == "pods" and verb == "GET" and name:
            return self._log(request, ns, name)
        if name is None:
            if verb == "GET":
                return await self._list_or_watch(request, plural, ns)
            if verb == "POST":
                return await self._create(request, plural, ns)
            if verb == "DELETE":
                return await self._delete_collection(request, plural, ns)
        else:
            return await self._one(request, verb, plural, ns, name)
        return _status(405, "MethodNotAllowed", f"{verb} {path}")

    async def _create(self, request: web.Request, plural: str, ns: str) -> web.Response:
        assert self.store is not None
        try:
            obj = self.store.create(plural, ns, await request.json())
        except KeyError as exc:
            return _status(409, "AlreadyExists", f'{plural} "{exc.args[0]}" already exists')
        except ValueError as exc:
            return _status(422, "Invalid", str(exc))
        return web.json_response(obj, status=201)

    async def _one(self, request: web.Request, verb: str, plural: str, ns: str, name: str) -> web.Response:
        assert self.store is not None
        if (plural, ns, name) not in self.store.objects:
            return _status(404, "NotFound", f'{plural} "{name}" not found')
        if verb == "GET":
            return web.json_response(self.store.objects[(plural, ns, name)])
        if verb == "PATCH":
            return web.json_response(self.store.patch(plural, ns, name, await request.json()))
        if verb == "DELETE":
            obj = self.store.delete(plural, ns, name, await self._propagation(request))
            return web.json_response(obj)
        return _status(405, "MethodNotAllowed", verb)

    async def _propagation(self, request: web.Request) -> str | None:
        if request.query.get("propagationPolicy"):
            return request.query["propagationPolicy"]
        if request.can_read_body:
            body = await request.read()
            if body:
                return json.loads(body).get("propagationPolicy")
        return None

    async def _delete_collection(self, request: web.Request, plural: str, ns: str) -> web.Response:
        assert self.store is not None
        policy = await self._propagation(request)
        gone = [self.store.delete(plural, ns, o["metadata"]["name"], policy)
                for o in self.store.select(plural, ns, request.query.get("labelSelector"))
                if (plural, ns, o["metadata"]["name"]) in self.store.objects]
        return web.json_response({"kind": "Status", "apiVersion": "v1", "status": "Success",
                                  "details": {"deleted": len(gone)}})

    def _log(self, request: web.Request, ns: str, name: str) -> web.Response:
        assert self.store is not None
        if ("pods", ns, name) not in self.store.objects:
            return _status(404, "NotFound", f'pods "{name}" not found')
        lines = self.store.logs.get((ns, name), [])
        tail = request.query.get("tailLines")
        if tail:
            lines = lines[-int(tail):]
        return web.Response(text="".join(lines), content_type="text/plain")

    async def _list_or_watch(self, request: web.Request, plural: str, ns: str | None) -> web.StreamResponse:
        assert self.store is not None
        selector = request.query.get("labelSelector")
        if request.query.get("watch", "").lower() not in ("true", "1"):
            items = copy.deepcopy(self.store.select(plural, ns, selector))
            return web.json_response({"kind": "List", "apiVersion": "v1", "items": items,
                                      "metadata": {"resourceVersion": str(self.store.rv)}})
        return await self._watch(request, plural, ns, selector)

    async def _watch(self, request: web.Request, plural: str, ns: str | None, selector: str | None
                     ) -> web.StreamResponse:
        assert self.store is not None
        store = self.store
        since = request.query.get("resourceVersion")
        oldest = store.history[0][0] if store.history else store.rv + 1
        if since and since != "0" and int(since) < oldest - 1 and len(store.history) >= _HISTORY:
            return _status(410, "Expired", f"too old resource version: {since} ({oldest - 1})")
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        try:
            if since and since != "0":
                cursor = int(since)
            else:  # no version: the current objects first, as ADDED
                cursor = store.rv
                for obj in store.select(plural, ns, selector):
                    await resp.write(json.dumps({"type": "ADDED", "object": obj}).encode() + b"\n")
            end = time.monotonic() + float(request.query.get("timeoutSeconds") or 1800)
            while time.monotonic() < end:
                start = bisect.bisect_right(store.history, cursor, key=lambda e: e[0])
                for rv, kind, p, obj in store.history[start:]:
                    cursor = rv
                    if p == plural and (ns is None or obj["metadata"].get("namespace") == ns) and \
                            _selector_matches(selector, obj["metadata"].get("labels") or {}):
                        await resp.write(json.dumps({"type": kind, "object": obj}).encode() + b"\n")
                if store.history and store.history[-1][0] > cursor:
                    continue  # more arrived while this stream was writing
                async with store.changed:
                    try:
                        await asyncio.wait_for(store.changed.wait(), max(0.01, min(5.0, end - time.monotonic())))
                    except asyncio.TimeoutError:
                        pass
            await resp.write_eof()
            return resp
        except ConnectionResetError:  # the client stopped its watch: nobody left to tell
            return resp
