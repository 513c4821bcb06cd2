"""A small fake Kubernetes API server on 127.0.0.1 for the kopf handler tests.

It serves what kopf and the operator use: discovery, list + watch (newline-delimited JSON events from a
resourceVersion), get, create (generateName too), replace, merge-patch and JSON-patch on objects and their
/status and /scale subresources, and delete with finalizers (deletionTimestamp) and ownerReference garbage
collection. Where the real one was seen to differ from a naive store, it does what the real one does
(fake_admission.py): unknown fields pruned or, under fieldValidation=Strict, refused; CRD schema defaults and
validation; a pod refused until its service account exists; resourceVersion preconditions (409 Conflict).
No scheduling, no kubelet, no controllers. Tests drive it through the sync helpers at the bottom.
"""
from __future__ import annotations

import asyncio
import copy
import datetime
import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonpatch
import yaml
from aiohttp import web

from fake_admission import Refused, admit, check_service_account, load_crd_kind
from fake_objects import get_path, matches, merge, set_path

CHART_CRDS = Path(__file__).resolve().parents[2] / "charts" / "cpuserve" / "crds"


@dataclass(frozen=True)
class Kind:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool = True
    status: bool = True
    builtin: bool = True
    """A built-in kind: its schema is Kubernetes' own (kubernetes-validate's copy)."""
    schema: dict[str, Any] | None = field(default=None, hash=False, compare=False)
    """A CRD's openAPIV3Schema (None: a built-in's, or no schema at all when not builtin)."""
    scale: dict[str, str] | None = field(default=None, hash=False, compare=False)
    """A CRD's scale subresource (specReplicasPath, statusReplicasPath, labelSelectorPath)."""


BUILTIN_KINDS = [
    Kind("", "v1", "pods", "Pod"), Kind("", "v1", "services", "Service"),
    Kind("", "v1", "events", "Event", status=False), Kind("", "v1", "namespaces", "Namespace", False),
    Kind("", "v1", "serviceaccounts", "ServiceAccount", status=False),
    Kind("", "v1", "secrets", "Secret", status=False),
    Kind("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget"),
    Kind("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy", status=False),
    # the Prometheus Operator's CRD is not in the chart: stored as given, like a CRD that preserves unknown fields
    Kind("monitoring.coreos.com", "v1", "servicemonitors", "ServiceMonitor", status=False, builtin=False)]


def chart_crds() -> list[dict[str, Any]]:
    """The CRDs `helm install` applies from charts/cpuserve/crds/."""
    return [doc for f in sorted(CHART_CRDS.glob("*.yaml")) for doc in yaml.safe_load_all(f.read_text()) if doc]


class FakeApiServer:
    def __init__(self, crds: list[dict[str, Any]] | None = None) -> None:
        """`crds`: the CustomResourceDefinitions installed (default: the chart's)."""
        self.kinds = BUILTIN_KINDS + [load_crd_kind(crd, Kind) for crd in (chart_crds() if crds is None else crds)]
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}  # (plural, ns, name) -> object
        self.log: list[tuple[int, str, str, str, dict[str, Any]]] = []  # (rv, plural, ns, type, object)
        self.requests: list[tuple[str, str, dict[str, str]]] = []  # (method, path, query) of every request
        self.request_times: list[float] = []  # time.monotonic() of each of those
        self.rv = 0
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._changed: asyncio.Condition | None = None
        self._closing = False
        self._runner: web.AppRunner | None = None
        self.warnings: list[str] = []  # Warning header values of the last write (the loop serves one at a time)
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    # ---- storage (runs on the server loop) ----
    def _emit(self, plural: str, ns: str, etype: str, obj: dict[str, Any]) -> None:
        self.log.append((self.rv, plural, ns, etype, copy.deepcopy(obj)))
        self._loop.create_task(self._notify())

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    def _bump(self, obj: dict[str, Any]) -> None:
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)

    def _create(self, kind: Kind, ns: str, obj: dict[str, Any], query: dict[str, str] | None = None) -> dict[str, Any]:
        """Raises Refused like the real server: AlreadyExists, admission (service account), schema."""
        meta = obj.setdefault("metadata", {})
        if "name" not in meta and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        key = (kind.plural, ns, meta.get("name", ""))
        if key in self.objects:
            raise Refused(409, "AlreadyExists", f'{kind.plural} "{key[2]}" already exists',
                          {"name": key[2], "kind": kind.plural})
        obj.pop("status", None) if kind.status and not kind.builtin else None  # a CRD's status: /status only
        self.warnings = admit(obj, kind, query or {})
        if kind.kind == "Pod":
            check_service_account(obj, ns, lambda sa: ("serviceaccounts", ns, sa) in self.objects)
        meta = obj["metadata"]
        obj.update(apiVersion=f"{kind.group}/{kind.version}".lstrip("/"), kind=kind.kind)
        meta.update(namespace=ns, uid=str(uuid.uuid4()), generation=1,
                    creationTimestamp=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
        self._bump(obj)
        self.objects[key] = obj
        self._emit(kind.plural, ns, "ADDED", obj)
        owners = {o.get("uid") for o in meta.get("ownerReferences") or []}
        if owners and not owners & {o["metadata"]["uid"] for o in self.objects.values()}:
            self._loop.call_soon(self._collect, key)  # like the real GC: an orphan from birth goes soon
        return obj

    def _collect(self, key: tuple[str, str, str]) -> None:
        if key in self.objects:
            self._delete(key)

    def _update(self, kind: Kind, key: tuple[str, str, str], new: dict[str, Any], sub: str | None,
                query: dict[str, str] | None = None) -> dict[str, Any]:
        """Replace the stored object by `new` (already patched), keeping what the subresource may not change.

        Raises Refused: 409 Conflict when `new` names a resourceVersion other than the stored one (an
        optimistic-lock precondition), 400/422 from admission.
        """
        old = self.objects[key]
        sent_rv = (new.get("metadata") or {}).get("resourceVersion")
        if sent_rv is not None and sent_rv != old["metadata"]["resourceVersion"]:
            raise Refused(409, "Conflict", f'Operation cannot be fulfilled on {kind.plural} "{key[2]}": the object '
                          "has been modified; please apply your changes to the latest version and try again",
                          {"name": key[2], "kind": kind.plural})
        if kind.status and sub == "status":
            new = {**old, "status": new.get("status", {})}
        elif kind.status:
            new = {**new, "status": old.get("status")} if "status" in old else {k: v for k, v in new.items() if k != "status"}
        for field in ("uid", "name", "namespace", "creationTimestamp", "generation"):
            if field in old["metadata"]:
                new["metadata"][field] = old["metadata"][field]
        self.warnings = admit(new, kind, query or {})
        if new.get("spec") != old.get("spec"):
            new["metadata"]["generation"] = old["metadata"]["generation"] + 1
        self._bump(new)
        if new["metadata"].get("deletionTimestamp") and not new["metadata"].get("finalizers"):
            return self._remove(key, new)
        self.objects[key] = new
        self._emit(kind.plural, key[1], "MODIFIED", new)
        return new

    def _remove(self, key: tuple[str, str, str], obj: dict[str, Any]) -> dict[str, Any]:
        self.objects.pop(key, None)
        self._emit(key[0], key[1], "DELETED", obj)
        uid = obj["metadata"]["uid"]
        for child_key, child in list(self.objects.items()):  # garbage collection by owner reference
            if any(o.get("uid") == uid for o in child["metadata"].get("ownerReferences") or []):
                self._delete(child_key)
        return obj

    def _delete(self, key: tuple[str, str, str]) -> dict[str, Any]:
        obj = self.objects[key]
        if obj["metadata"].get("finalizers"):
            if not obj["metadata"].get("deletionTimestamp"):
                obj = copy.deepcopy(obj)
                obj["metadata"]["deletionTimestamp"] = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
                self._bump(obj)
                self.objects[key] = obj
                self._emit(key[0], key[1], "MODIFIED", obj)
            return obj
        return self._remove(key, obj)

    # ---- HTTP ----
    def _discovery(self, parts: list[str]) -> dict[str, Any] | None:
        if parts == ["version"]:
            return {"major": "1", "minor": "34", "gitVersion": "v1.34.0"}
        if parts == ["api"]:
            return {"kind": "APIVersions", "versions": ["v1"]}
        if parts == ["apis"]:
            groups = sorted({(k.group, k.version) for k in self.kinds if k.group})
            return {"kind": "APIGroupList", "groups": [
                {"name": g, "versions": [{"groupVersion": f"{g}/{v}", "version": v}],
                 "preferredVersion": {"groupVersion": f"{g}/{v}", "version": v}} for g, v in groups]}
        gv = ("", parts[1]) if parts[0] == "api" and len(parts) == 2 else \
            (parts[1], parts[2]) if parts[0] == "apis" and len(parts) == 3 else None
        if gv is None:
            return None
        kinds = [k for k in self.kinds if (k.group, k.version) == gv]
        if not kinds:
            return None
        verbs = ["create", "delete", "get", "list", "patch", "update", "watch"]
        resources = [{"name": k.plural, "singularName": k.kind.lower(), "namespaced": k.namespaced, "kind": k.kind,
                      "verbs": verbs} for k in kinds]
        resources += [{"name": f"{k.plural}/status", "singularName": "", "namespaced": k.namespaced,
                       "kind": k.kind, "verbs": ["get", "patch", "update"]} for k in kinds if k.status]
        return {"kind": "APIResourceList", "groupVersion": "/".join(filter(None, gv)), "resources": resources}

    def _route(self, parts: list[str]) -> tuple[Kind, str | None, str | None, str | None] | None:
        """(kind, namespace, name, subresource) of a resource path."""
        head, rest = (("", "v1"), parts[2:]) if parts[:2] == ["api", "v1"] else \
            ((parts[1], parts[2]), parts[3:]) if parts[:1] == ["apis"] and len(parts) > 3 else (None, [])
        if head is None:
            return None
        ns = None
        if len(rest) >= 3 and rest[0] == "namespaces":
            ns, rest = rest[1], rest[2:]
        kind = next((k for k in self.kinds if (k.group, k.version) == head and k.plural == rest[0]), None)
        if kind is None:
            return None
        return kind, ns, rest[1] if len(rest) > 1 else None, rest[2] if len(rest) > 2 else None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.requests.append((request.method, request.path, dict(request.query)))
        self.request_times.append(time.monotonic())
        parts = [p for p in request.path.split("/") if p]
        if request.method == "GET" and (doc := self._discovery(parts)) is not None:
            return web.json_response(doc)
        route = self._route(parts)
        if route is None:
            return web.json_response({"kind": "Status", "code": 404, "message": request.path}, status=404)
        kind, ns, name, sub = route
        if request.method == "GET" and name is None:
            if request.query.get("watch") in ("true", "1"):
                return await self._watch(request, kind, ns)
            items = [o for (p, n, _), o in sorted(self.objects.items()) if p == kind.plural and ns in (None, n)
                     and matches(o["metadata"].get("labels") or {}, request.query.get("labelSelector", ""))]
            return web.json_response({"kind": f"{kind.kind}List", "items": items,
                                      "metadata": {"resourceVersion": str(self.rv)}})
        if sub is not None and not (sub == "status" and kind.status or sub == "scale" and kind.scale):
            return web.json_response(Refused(404, "NotFound", f"{kind.plural}/{sub}: no such subresource").status,
                                     status=404)
        try:
            return await self._write(request, kind, ns or "", name, sub)
        except Refused as err:
            return web.json_response(err.status, status=err.code)

    async def _write(self, request: web.Request, kind: Kind, ns: str, name: str | None,
                     sub: str | None) -> web.StreamResponse:
        """GET one, POST, PUT, PATCH, DELETE; Warning headers for pruned unknown fields."""
        query = dict(request.query)
        if request.method == "POST":
            obj = self._create(kind, ns, await request.json(), query)
            return web.json_response(obj, status=201, headers=self._warning_headers())
        key = (kind.plural, ns, name or "")
        if key not in self.objects:
            raise Refused(404, "NotFound", f'{kind.plural} "{key[2]}" not found', {"name": key[2], "kind": kind.plural})
        if request.method == "GET":
            return web.json_response(self._scale(kind, self.objects[key]) if sub == "scale" else self.objects[key])
        if request.method == "DELETE":
            return web.json_response(self._delete(key))
        if request.method not in ("PATCH", "PUT"):
            raise Refused(405, "MethodNotAllowed", f"{request.method} is not supported here")
        payload = await request.json()
        current = copy.deepcopy(self._scale(kind, self.objects[key]) if sub == "scale" else self.objects[key])
        if request.method == "PUT":
            if not (payload.get("metadata") or {}).get("resourceVersion"):
                raise Refused(422, "Invalid", f'{kind.kind} "{key[2]}" is invalid: metadata.resourceVersion: '
                              "Invalid value: 0x0: must be specified for an update")
            new = payload
        elif request.content_type == "application/json-patch+json":
            new = jsonpatch.apply_patch(current, payload)
        else:
            new = merge(current, payload)
        if sub == "scale":  # the Scale's spec.replicas lands at the CRD's specReplicasPath
            scaled = copy.deepcopy(self.objects[key])
            scaled["metadata"]["resourceVersion"] = new["metadata"].get("resourceVersion")
            set_path(scaled, kind.scale["specReplicasPath"], (new.get("spec") or {}).get("replicas"))
            return web.json_response(self._scale(kind, self._update(kind, key, scaled, None, query)))
        return web.json_response(self._update(kind, key, new, sub, query), headers=self._warning_headers())

    def _warning_headers(self) -> dict[str, str]:
        return {"Warning": ", ".join(self.warnings)} if self.warnings else {}

    @staticmethod
    def _scale(kind: Kind, obj: dict[str, Any]) -> dict[str, Any]:
        """The autoscaling/v1 Scale view of an object with a scale subresource."""
        meta = obj["metadata"]
        return {"kind": "Scale", "apiVersion": "autoscaling/v1",
                "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")},
                "spec": {"replicas": get_path(obj, kind.scale["specReplicasPath"]) or 0},
                "status": {"replicas": get_path(obj, kind.scale["statusReplicasPath"]) or 0,
                           "selector": get_path(obj, kind.scale.get("labelSelectorPath", "")) or ""}}

    async def _watch(self, request: web.Request, kind: Kind, ns: str | None) -> web.StreamResponse:
        since = int(request.query.get("resourceVersion") or self.rv)
        deadline = time.monotonic() + float(request.query.get("timeoutSeconds") or 30)
        selector = request.query.get("labelSelector", "")
        rsp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await rsp.prepare(request)
        while not self._closing and time.monotonic() < deadline:
            for rv, plural, obj_ns, etype, obj in [e for e in self.log if e[0] > since]:
                since = rv
                if plural == kind.plural and ns in (None, obj_ns) and matches(obj["metadata"].get("labels") or {}, selector):
                    await rsp.write(json.dumps({"type": etype, "object": obj}).encode() + b"\n")
            async with self._changed:
                try:
                    await asyncio.wait_for(self._changed.wait(), timeout=0.5)
                except TimeoutError:
                    pass
        return rsp

    # ---- lifecycle and sync helpers for tests ----
    async def _start(self) -> None:
        self._changed = asyncio.Condition()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self._runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    def start(self) -> FakeApiServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def stop(self) -> None:
        self._closing = True
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _sync(self, fn, *args):
        async def call():
            return fn(*args)
        return asyncio.run_coroutine_threadsafe(call(), self._loop).result(10)

    def kind(self, plural: str) -> Kind:
        return next(k for k in self.kinds if k.plural == plural)

    def create(self, plural: str, ns: str, obj: dict[str, Any]) -> dict[str, Any]:
        return self._sync(self._create, self.kind(plural), ns, copy.deepcopy(obj))

    def patch(self, plural: str, ns: str, name: str, patch: dict[str, Any], sub: str | None = None) -> dict[str, Any]:
        key = (plural, ns, name)
        return self._sync(lambda: self._update(self.kind(plural), key, merge(copy.deepcopy(self.objects[key]), patch), sub))

    def delete(self, plural: str, ns: str, name: str) -> dict[str, Any]:
        return self._sync(self._delete, (plural, ns, name))

    def get(self, plural: str, ns: str, name: str) -> dict[str, Any] | None:
        return self._sync(lambda: copy.deepcopy(self.objects.get((plural, ns, name))))

    def names(self, plural: str, ns: str) -> list[str]:
        return self._sync(lambda: sorted(n for p, s, n in self.objects if p == plural and s == ns))
