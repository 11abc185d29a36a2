"""Gateway overhead: direct to the test LLM server vs through the gateway, in one run.

    python bench/bench_gateway.py [--seq 200] [--conc 32[,256]] [--conc-requests 4000] [--max-seconds 20]
                                  [--agl-python PYTHON]

Starts the deterministic test server (`lightning_middleware.testing.llm_server`) and the
gateway (`lightning-mw gateway`, SQLite store in a temp dir) as subprocesses on
loopback, then measures from this process with an asyncio aiohttp client:

- sequential per-call latency p50/p99 (one call at a time, round-robin over direct and
  the gateways so that all see the same machine state),
- per-call latency p50/p99 and throughput at `--conc` concurrent callers,
- the same for `floor`: a pass-through proxy with no logic (aiohttp in and out), whose
  added latency is what one more loopback hop costs on this machine,

for non-streaming and streaming chat completions. Direct requests carry
`return_token_ids` and `logprobs`, which the gateway injects, so the engine does
the same work on both paths. Gateway calls go to per-rollout base URLs (one
rollout per concurrent caller) with distinct bodies, so nothing is deduplicated:
every call is forwarded, captured and written to the store. Each phase stops
at its request count or `--max-seconds`, whichever comes first.

With `--agl-python`, the reference implementation's gateway (agentlightning 1.0.2's server and
its LLM proxy, started with its own entry point from that interpreter's environment) is one more
target, called on its per-rollout proxy URLs in its `train` mode (which injects token IDs and
logprobs, as ours does). It refuses streams (HTTP 400), so its stream rows say so.
`bench/bench_gateway_vs_agl.py` builds that environment and runs this.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

import aiohttp
import httpx
import orjson

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from lightning_middleware.testing import LLMTestServer, free_port, process_cpu_seconds  # noqa: E402


def _pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))]


def _summary(lat: list[float]) -> dict:
    return {"n": len(lat), "p50": _pct(lat, 50) * 1000, "p99": _pct(lat, 99) * 1000,
            "mean": statistics.fmean(lat) * 1000}


def _body(i: int, stream: bool, direct: bool) -> dict:
    body: dict = {"model": "m", "max_tokens": 32, "stream": stream,
                  "messages": [{"role": "system", "content": "be brief"},
                               {"role": "user", "content": f"question number {i}: what is {i}+{i}?"}]}
    if direct:
        body.update(return_token_ids=True, logprobs=True)
    return body


async def _one(session: aiohttp.ClientSession, url: str, body: dict) -> float:
    t0 = time.perf_counter()
    async with session.post(url, data=orjson.dumps(body), headers={"content-type": "application/json"}) as r:
        if body["stream"]:
            async for _ in r.content.iter_any():
                pass
        else:
            await r.read()
        assert r.status == 200, r.status
    return time.perf_counter() - t0


async def _phase(urls: list[str], stream: bool, direct: bool, callers: int, total: int, max_s: float) -> dict:
    # The load generator is aiohttp (C parser, cheap pool) so that it is not what limits the direct
    # path: with an httpx client at 32 concurrent, its own pool work capped the direct req/s.
    connector = aiohttp.TCPConnector(limit=callers * 2)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as client:
        for url in urls[:callers]:  # warm the connections
            body = _body(-1, stream, direct)
            body["messages"][1]["content"] += f" warm {uuid.uuid4().hex}"
            await _one(client, url, body)
        lat: list[float] = []
        counter = iter(range(total))
        deadline = time.perf_counter() + max_s
        salt = uuid.uuid4().hex[:6]

        async def worker(k: int) -> None:
            url = urls[k % len(urls)]
            for i in counter:
                if time.perf_counter() > deadline:
                    return
                body = _body(i, stream, direct)
                body["messages"][1]["content"] += f" [{salt}]"
                lat.append(await _one(client, url, body))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(k) for k in range(callers)))
        wall = time.perf_counter() - t0
    return {**_summary(lat), "rps": len(lat) / wall}


async def _seq_interleaved(targets: dict[str, tuple[list[str], bool]], stream: bool, total: int,
                           max_s: float) -> dict[str, dict]:
    """One call at a time, round-robin over the targets (direct, floor, gateway), so that every
    target sees the same machine: a VM's wake-up latency drifts by tenths of a millisecond
    between back-to-back phases, as much as the gateway adds."""
    connector = aiohttp.TCPConnector(limit=4 * len(targets))
    lat: dict[str, list[float]] = {name: [] for name in targets}
    salt = uuid.uuid4().hex[:6]
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as client:
        for urls, direct in targets.values():  # warm each connection
            body = _body(-1, stream, direct)
            body["messages"][1]["content"] += f" warm {uuid.uuid4().hex}"
            await _one(client, urls[0], body)
        deadline = time.perf_counter() + max_s
        for i in range(total):
            if time.perf_counter() > deadline:
                break
            for name, (urls, direct) in targets.items():
                body = _body(i, stream, direct)
                body["messages"][1]["content"] += f" [{salt}]"
                lat[name].append(await _one(client, urls[0], body))
    return {name: _summary(v) for name, v in lat.items()}


def _passthrough_server(upstream: str, port: int) -> None:
    """The floor: a proxy with no logic at all (aiohttp server + aiohttp client, body relayed
    as bytes, streams chunk by chunk). What it adds is the cost of one more loopback hop and
    process wake-up on this machine, which no gateway can avoid."""
    from aiohttp import web

    async def serve() -> None:
        session = aiohttp.ClientSession(auto_decompress=False)

        async def handler(request: web.Request) -> web.StreamResponse:
            body = await request.read()
            async with session.post(upstream + "/chat/completions", data=body,
                                    headers={"content-type": "application/json"}) as r:
                if "text/event-stream" not in r.headers.get("content-type", ""):
                    return web.Response(body=await r.read(), status=r.status, content_type="application/json")
                out = web.StreamResponse(status=r.status, headers={"content-type": "text/event-stream"})
                await out.prepare(request)
                async for chunk in r.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
                return out

        app = web.Application()
        app.router.add_post("/v1/chat/completions", handler)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        await asyncio.Event().wait()

    try:
        import uvloop  # the gateway runs on uvloop too (uvicorn[standard])

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve())


def _start_passthrough(upstream: str, port: int, log_path: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--passthrough-server", upstream, str(port)],
                            stdout=subprocess.DEVNULL, stderr=open(log_path, "wb"))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(open(log_path).read()[-3000:])
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise TimeoutError("pass-through proxy did not start")


def _start_gateway(upstream: str, store_url: str, port: int, log_path: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "lightning_middleware.cli", "gateway", "--upstream", upstream,
                             "--store", store_url, "--port", str(port), "--policy-version", "1"],
                            env=env, stdout=subprocess.DEVNULL, stderr=open(log_path, "wb"))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(open(log_path).read()[-3000:])
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.05)
    proc.kill()
    raise TimeoutError("gateway did not start")


AGL_MODEL = "m"


def _start_agl(python: str, upstream: str, port: int, workdir: str, log_path: str) -> subprocess.Popen:
    """The reference gateway as its users start it: its hydra entry point, its shipped defaults
    (uvicorn's access log on, as `agentlightning.server.__main__` leaves it), no API key."""
    proc = subprocess.Popen([python, "-m", "agentlightning.server", "host=127.0.0.1", f"port={port}", "key=",
                             f"default_proxy.model_name={AGL_MODEL}", f"hydra.run.dir={workdir}",
                             "hydra.output_subdir=null"],
                            cwd=workdir, stdout=subprocess.DEVNULL, stderr=open(log_path, "wb"))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(open(log_path).read()[-3000:])
        try:
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                httpx.post(url + "/api/models", json=[{"model": AGL_MODEL, "endpoint": upstream}]).raise_for_status()
                return proc
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise TimeoutError("agentlightning server did not start")


def _agl_rollout_urls(url: str, n: int) -> tuple[list[str], list[str]]:
    """(rollout ids, their proxy URLs) on the reference's server, as `_rollout_urls` on ours."""
    rids = [f"bench-{uuid.uuid4().hex[:10]}" for _ in range(n)]
    httpx.post(url + "/api/rollouts", json=[{"input": {"k": k}, "rollout_id": rid} for k, rid in enumerate(rids)],
               timeout=30).raise_for_status()
    return rids, [f"{url}/proxy/rollout/{rid}/attempt/0/mode/train/openai/v1/chat/completions" for rid in rids]


def _refuses_streams(url: str) -> int | None:
    """The HTTP status a target answers a stream request with, when it refuses it (else None)."""
    r = httpx.post(url, json=_body(-1, True, False), timeout=30)
    return r.status_code if r.status_code != 200 else None


def _rollout_urls(gw_url: str, n: int) -> tuple[list[str], list[str]]:
    rids = []
    for k in range(n):
        rid = f"bench-{uuid.uuid4().hex[:10]}"
        httpx.post(gw_url + "/rollouts", json={"id": rid, "task_id": f"bench-{k % 4}"}).raise_for_status()
        rids.append(rid)
    return rids, [f"{gw_url}/rollouts/{rid}/v1/chat/completions" for rid in rids]


def _print_table(names: list[str], concs: list[int], results: dict, cpu: dict, refused: dict[str, int]) -> None:
    """Every target side by side: latency, req/s as a ratio of direct, CPU per call; a target that
    refused a mode says so in its cells."""
    header = f"{'mode':10s} {'metric':26s}" + "".join(f" {n:>10s}" for n in names) + "".join(
        f" {'added ' + n:>14s}" for n in names[1:])
    print(header)
    print("-" * len(header))

    def cells(stream: bool, phase: str, key: str) -> list[float | None]:
        return [None if (n, stream, phase) not in results else results[(n, stream, phase)][key] for n in names]

    def fmt(v: float | None, spec: str, width: int) -> str:
        return f" {'refused' if v is None else format(v, spec):>{width}s}"

    for stream in (False, True):
        mode = "stream" if stream else "non-stream"
        rows = [("p50 ms, sequential", "seq", "p50"), ("p99 ms, sequential", "seq", "p99")]
        for c in concs:
            rows += [(f"p50 ms, {c} concurrent", f"conc{c}", "p50"), (f"p99 ms, {c} concurrent", f"conc{c}", "p99")]
        for label, phase, key in rows:
            vals = cells(stream, phase, key)
            base = vals[0]
            assert base is not None
            print(f"{mode:10s} {label:26s}" + "".join(fmt(v, ".2f", 10) for v in vals)
                  + "".join(fmt(None if v is None else v - base, "+.2f", 14) for v in vals[1:]))
        for c in concs:
            rps = cells(stream, f"conc{c}", "rps")
            base = rps[0]
            assert base is not None
            print(f"{mode:10s} {f'req/s, {c} concurrent':26s}" + "".join(fmt(v, ".1f", 10) for v in rps)
                  + "".join(fmt(None if v is None else v / base, ".2f", 13) + ("x" if v is not None else " ")
                            for v in rps[1:]))
            per = [cpu.get((n, stream, c), (None, None)) for n in names]
            label = f"CPU ms/call, engine ({c})"
            print(f"{mode:10s} {label:26s}" + "".join(fmt(p[0], ".2f", 10) for p in per))
            label = f"CPU ms/call, gw ({c})"
            print(f"{mode:10s} {label:26s} {'':>10s}" + "".join(fmt(p[1], ".2f", 10) for p in per[1:]))
            label = f"calls measured (seq/{c})"
            print(f"{mode:10s} {label:26s}" + "".join(
                f" {'refused':>10s}" if (n, stream, "seq") not in results
                else f" {results[(n, stream, 'seq')]['n']:>4d}/{results[(n, stream, f'conc{c}')]['n']:<5d}"
                for n in names))
    for stream in (False, True):
        floor = results[("floor", stream, "seq")]["p50"]
        print(f"{'stream' if stream else 'non-stream':10s} sequential p50 over the floor (the gateway's own work): "
              + ", ".join(f"{n} {results[(n, stream, 'seq')]['p50'] - floor:+.2f} ms" for n in names[2:]
                          if (n, stream, "seq") in results))
    for name, status in refused.items():
        print(f"{name} refuses stream requests: HTTP {status}")


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--passthrough-server":  # the floor proxy's own process
        _passthrough_server(sys.argv[2], int(sys.argv[3]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=200, help="sequential calls per phase")
    ap.add_argument("--conc", default="32", help="concurrent callers; several, comma-separated, one phase each")
    ap.add_argument("--conc-requests", type=int, default=4000, help="calls per concurrent phase")
    ap.add_argument("--max-seconds", type=float, default=20.0, help="time cap per phase")
    ap.add_argument("--engine-ms", type=float, default=0.0,
                    help="time the test server takes per completion, as a real engine would (the reference "
                         "anchor's upstream answered in ~15 ms); 0 = answer at once (gateway CPU-bound)")
    ap.add_argument("--engine-cpu-ms", type=float, default=0.0,
                    help="CPU the test server computes per completion, one at a time (an engine that fills a "
                         "core and competes with the gateway for the machine; 10 = at most ~100 req/s, the "
                         "reference anchor's direct rate)")
    ap.add_argument("--agl-python", default=None,
                    help="a Python with agentlightning installed: its gateway becomes one more target")
    args = ap.parse_args()
    concs = [int(c) for c in str(args.conc).split(",")]

    tmp = tempfile.mkdtemp(prefix="bench_gw_")
    store_url = f"sqlite:///{tmp}/traces.db"
    names = ["direct", "floor", "gateway"] + (["agl"] if args.agl_python else [])
    results: dict[tuple[str, bool, str], dict] = {}
    cpu: dict[tuple[str, bool, int], tuple] = {}
    refused: dict[str, int] = {}
    all_rids: list[str] = []
    states = {}
    with LLMTestServer(latency_ms=args.engine_ms, cpu_ms=args.engine_cpu_ms) as server:
        procs: dict[str, subprocess.Popen] = {}
        try:
            port = free_port()
            procs["gateway"] = _start_gateway(server.base_url, store_url, port, os.path.join(tmp, "gateway.log"))
            gw_url = f"http://127.0.0.1:{port}"
            floor_port = free_port()
            procs["floor"] = _start_passthrough(server.base_url, floor_port, os.path.join(tmp, "floor.log"))
            n_urls = max(concs)
            rids, gw_urls = _rollout_urls(gw_url, n_urls)
            all_rids += rids
            urls: dict[str, tuple[list[str], bool]] = {
                "direct": ([server.base_url + "/chat/completions"], True),
                # the floor forwards what it is sent, so it gets the direct body (token IDs asked for)
                "floor": ([f"http://127.0.0.1:{floor_port}/v1/chat/completions"], True),
                "gateway": (gw_urls, False)}
            if args.agl_python:
                agl_port = free_port()
                agl_dir = os.path.join(tmp, "agl")
                os.makedirs(agl_dir)
                procs["agl"] = _start_agl(args.agl_python, server.base_url, agl_port, agl_dir,
                                          os.path.join(tmp, "agl.log"))
                agl_url = f"http://127.0.0.1:{agl_port}"
                agl_rids, agl_urls = _agl_rollout_urls(agl_url, n_urls)
                urls["agl"] = (agl_urls, False)
            for name in names:
                status = _refuses_streams(urls[name][0][0])
                if status is not None:
                    refused[name] = status
            for stream in (False, True):
                live = {n: u for n, u in urls.items() if not (stream and n in refused)}
                print(f"... sequential, interleaved, {'stream' if stream else 'non-stream'}", file=sys.stderr,
                      flush=True)
                seq = asyncio.run(_seq_interleaved(live, stream, args.seq, args.max_seconds * len(live)))
                for name in live:
                    results[(name, stream, "seq")] = seq[name]
                for c in concs:
                    for name in live:
                        print(f"... {name} {'stream' if stream else 'non-stream'} {c} concurrent", file=sys.stderr,
                              flush=True)
                        pid = procs[name].pid if name in procs else None
                        cpu0 = (process_cpu_seconds(server.pid), pid and process_cpu_seconds(pid))  # type: ignore[arg-type]
                        phase_urls, direct = live[name]
                        r = asyncio.run(_phase(phase_urls, stream, direct, c, args.conc_requests, args.max_seconds))
                        results[(name, stream, f"conc{c}")] = r
                        cpu1 = (process_cpu_seconds(server.pid), pid and process_cpu_seconds(pid))  # type: ignore[arg-type]
                        n = r["n"] + c  # CPU of the concurrent phase only (the warm-up calls included)
                        cpu[(name, stream, c)] = tuple(
                            None if not a or not b else (b - a) * 1000 / n for a, b in zip(cpu0, cpu1))
            for rid in rids:
                httpx.post(gw_url + f"/rollouts/{rid}/finish", json={"reward": 1.0}, timeout=60).raise_for_status()
            states["gateway"] = httpx.get(gw_url + "/admin/state").json()["counters"]
            if "agl" in urls:  # what the reference recorded (in its memory: it has no durable store)
                states["agl"] = {"model_request events": sum(
                    len(httpx.get(f"{agl_url}/api/rollouts/{rid}/events", params={"event_type": "model_request"},
                                  timeout=60).json()) for rid in agl_rids)}
        finally:
            for proc in procs.values():
                proc.terminate()
                proc.wait(15)

    from lightning_middleware import TraceStore

    store = TraceStore(store_url)
    recorded = store.count("llm_calls")
    training = sum(len(v) for v in store.calls_for(all_rids, training_only=True).values())
    store.close()
    shutil.rmtree(tmp, ignore_errors=True)

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"gateway benchmark: {os.cpu_count()} cores (load average {load:.1f}), loopback, Python "
          f"{sys.version.split()[0]}, SQLite store, engine {args.engine_ms:g} ms + {args.engine_cpu_ms:g} ms "
          f"CPU/completion; sequential n={args.seq}, "
          f"{'/'.join(map(str, concs))} concurrent n<={args.conc_requests}, cap {args.max_seconds:g}s/phase")
    _print_table(names, concs, results, cpu, refused)
    print(f"recorded llm_calls: {recorded} (training: {training}); counters: {states}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
