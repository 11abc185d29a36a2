"""Gateway overhead: direct to the test LLM server vs through the gateway, in one run.

    python bench/bench_gateway.py [--seq 200] [--conc 32] [--conc-requests 1000] [--max-seconds 20]

Starts the deterministic test server (`lightning_middleware.testing`) and the
gateway (`lightning-mw gateway`, SQLite store in a temp dir) as subprocesses on
loopback, then measures from this process with an asyncio httpx client:

- sequential per-call latency p50/p99 (one call at a time),
- per-call latency p50/p99 and throughput at `--conc` concurrent callers,

for non-streaming and streaming chat completions. Direct requests carry
`return_token_ids` and `logprobs`, which the gateway injects, so the engine does
the same work on both paths. Gateway calls go to per-rollout base URLs (one
rollout per concurrent caller) with distinct bodies, so nothing is deduplicated:
every call is forwarded, captured and written to the store. Each phase stops
at its request count or `--max-seconds`, whichever comes first.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from lightning_middleware.testing import LLMTestServer, free_port  # noqa: E402


def _pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))]


def _cpu_s(pid: int) -> float | None:
    """User+system CPU seconds of a process so far (Linux), None elsewhere."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _body(i: int, stream: bool, direct: bool) -> dict:
    body: dict = {"model": "m", "max_tokens": 32, "stream": stream,
                  "messages": [{"role": "system", "content": "be brief"},
                               {"role": "user", "content": f"question number {i}: what is {i}+{i}?"}]}
    if direct:
        body.update(return_token_ids=True, logprobs=True)
    return body


async def _one(client: httpx.AsyncClient, url: str, body: dict) -> float:
    t0 = time.perf_counter()
    if body["stream"]:
        async with client.stream("POST", url, json=body) as r:
            async for _ in r.aiter_raw():
                pass
            assert r.status_code == 200, r.status_code
    else:
        r = await client.post(url, json=body)
        assert r.status_code == 200, r.text
    return time.perf_counter() - t0


async def _phase(urls: list[str], stream: bool, direct: bool, callers: int, total: int, max_s: float) -> dict:
    limits = httpx.Limits(max_connections=callers * 2, max_keepalive_connections=callers * 2)
    async with httpx.AsyncClient(limits=limits, timeout=60) as client:
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
    return {"n": len(lat), "p50": _pct(lat, 50) * 1000, "p99": _pct(lat, 99) * 1000,
            "mean": statistics.fmean(lat) * 1000, "rps": len(lat) / wall}


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=200, help="sequential calls per phase")
    ap.add_argument("--conc", type=int, default=32, help="concurrent callers")
    ap.add_argument("--conc-requests", type=int, default=1000, help="calls per concurrent phase")
    ap.add_argument("--max-seconds", type=float, default=20.0, help="time cap per phase")
    ap.add_argument("--engine-ms", type=float, default=0.0,
                    help="time the test server takes per completion, as a real engine would (the reference "
                         "anchor's upstream answered in ~15 ms); 0 = answer at once (gateway CPU-bound)")
    args = ap.parse_args()

    tmp = tempfile.mkdtemp(prefix="bench_gw_")
    store_url = f"sqlite:///{tmp}/traces.db"
    port = free_port()
    with LLMTestServer(latency_ms=args.engine_ms) as server:
        log_path = os.path.join(tmp, "gateway.log")
        gw = _start_gateway(server.base_url, store_url, port, log_path)
        try:
            gw_url = f"http://127.0.0.1:{port}"
            rids = []
            for k in range(args.conc):
                rid = f"bench-{uuid.uuid4().hex[:10]}"
                httpx.post(gw_url + "/rollouts", json={"id": rid, "task_id": f"bench-{k % 4}"}).raise_for_status()
                rids.append(rid)
            gw_urls = [f"{gw_url}/rollouts/{rid}/v1/chat/completions" for rid in rids]
            direct_urls = [server.base_url + "/chat/completions"]
            results: dict[tuple[str, bool, str], dict] = {}
            cpu: dict[tuple[str, bool], tuple] = {}
            for stream in (False, True):
                for name, urls, direct in (("direct", direct_urls, True), ("gateway", gw_urls, False)):
                    print(f"... {name} {'stream' if stream else 'non-stream'}", file=sys.stderr, flush=True)
                    cpu0 = (_cpu_s(server._proc.pid), _cpu_s(gw.pid))  # type: ignore[union-attr]
                    results[(name, stream, "seq")] = asyncio.run(
                        _phase(urls, stream, direct, 1, args.seq, args.max_seconds))
                    results[(name, stream, "conc")] = asyncio.run(
                        _phase(urls, stream, direct, args.conc, args.conc_requests, args.max_seconds))
                    cpu1 = (_cpu_s(server._proc.pid), _cpu_s(gw.pid))  # type: ignore[union-attr]
                    n = results[(name, stream, "seq")]["n"] + results[(name, stream, "conc")]["n"] + args.conc + 1
                    cpu[(name, stream)] = tuple(
                        None if a is None or b is None else (b - a) * 1000 / n for a, b in zip(cpu0, cpu1))
            for rid in rids:
                httpx.post(gw_url + f"/rollouts/{rid}/finish", json={"reward": 1.0}, timeout=60).raise_for_status()
            state = httpx.get(gw_url + "/admin/state").json()
        finally:
            gw.terminate()
            gw.wait(15)

    from lightning_middleware import TraceStore

    store = TraceStore(store_url)
    recorded = store.count("llm_calls")
    training = sum(len(v) for v in store.calls_for(rids, training_only=True).values())
    store.close()
    shutil.rmtree(tmp, ignore_errors=True)

    print(f"gateway benchmark: {os.cpu_count()} cores, loopback, Python {sys.version.split()[0]}, "
          f"SQLite store, engine {args.engine_ms:g} ms/completion; sequential n={args.seq}, "
          f"{args.conc} concurrent n<={args.conc_requests}, "
          f"cap {args.max_seconds:g}s/phase")
    header = f"{'mode':10s} {'metric':26s} {'direct':>10s} {'gateway':>10s} {'added':>10s} {'ratio':>7s}"
    print(header)
    print("-" * len(header))
    for stream in (False, True):
        mode = "stream" if stream else "non-stream"
        d_seq, g_seq = results[("direct", stream, "seq")], results[("gateway", stream, "seq")]
        d_c, g_c = results[("direct", stream, "conc")], results[("gateway", stream, "conc")]
        rows = [
            ("p50 ms, sequential", d_seq["p50"], g_seq["p50"]),
            ("p99 ms, sequential", d_seq["p99"], g_seq["p99"]),
            (f"p50 ms, {args.conc} concurrent", d_c["p50"], g_c["p50"]),
            (f"p99 ms, {args.conc} concurrent", d_c["p99"], g_c["p99"]),
        ]
        for label, d, g in rows:
            print(f"{mode:10s} {label:26s} {d:10.2f} {g:10.2f} {g - d:+10.2f} {g / d:6.2f}x")
        print(f"{mode:10s} {'req/s, ' + str(args.conc) + ' concurrent':26s} {d_c['rps']:10.1f} {g_c['rps']:10.1f} "
              f"{g_c['rps'] - d_c['rps']:+10.1f} {g_c['rps'] / d_c['rps']:6.2f}x")
        (srv_d, _), (srv_g, gw_cpu) = cpu[("direct", stream)], cpu[("gateway", stream)]
        if srv_d is not None and srv_g is not None and gw_cpu is not None:
            print(f"{mode:10s} {'CPU ms/call (engine+gw)':26s} {srv_d:10.2f} {srv_g + gw_cpu:10.2f} "
                  f"{srv_g + gw_cpu - srv_d:+10.2f} {(srv_g + gw_cpu) / srv_d:6.2f}x   (gateway process: {gw_cpu:.2f})")
        print(f"{mode:10s} {'calls measured (seq/conc)':26s} {d_seq['n']:>4d}/{d_c['n']:<5d} "
              f"{g_seq['n']:>4d}/{g_c['n']:<5d}")
    print(f"recorded llm_calls: {recorded} (training: {training}); gateway counters: {state['counters']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
