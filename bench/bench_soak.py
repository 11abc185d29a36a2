"""Soak: a bounded load run on PostgreSQL, every part in its own process, nothing lost, memory flat.

    python bench/bench_soak.py [--minutes 30] [--wrap-agents 16] [--gateway-agents 16] [--json out.json]

Starts, each as a subprocess: a throwaway PostgreSQL server (fsync off: durability is not what
this measures, and the machine's disk is shared), the deterministic test LLM server (with
`--llm-latency-ms` per completion), `lightning-mw gateway` on that store, `lightning-mw trainer`
(the real TrainerDaemon and TorchEngine on a tiny byte-level Qwen2 that trains on the test
server's token IDs; it claims groups and commits steps, it publishes nothing), and two agent
processes (bench/soak_agents.py): one of `wrap()`-ed openai agents writing the store
themselves, one of agents calling through the gateway.

Every `--sample-s` it samples each process's resident memory (psutil; PostgreSQL as the sum of
its processes' PSS, so that shared buffers count once) and the store's counts. At the end it
lets the trainer drain, then checks, per kind of agent, the agents' own counts against the store:
calls sent = calls recorded, calls answered = training calls, rollouts finished = rollouts
recorded = trained + still waiting for a full step; and that no rollout was trained twice.
It prints a table per window (calls/s, latency p50/p99 per kind, counts, memory, load average)
and one JSON line with everything (also written to `--json`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any

import httpx
import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from soak_report import check_counts, memory_summary, print_report, window_rows  # noqa: E402

from lightning_middleware.testing import LLMTestServer, PostgresTestServer, free_port  # noqa: E402

ENV = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "PYTHONUNBUFFERED": "1"}
CLI = [sys.executable, "-m", "lightning_middleware.cli"]
GROUP_SIZE = 4


def save_tiny_model(out: Path) -> Path:
    """A 260-token byte-level Qwen2: the test server's token IDs are UTF-8 bytes (+ specials)."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=260, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                                   tie_word_embeddings=True)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(out)
    (out / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 1024}))
    return out


def wait_http(url: str, proc: subprocess.Popen[Any], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer within {timeout:.0f} s")


class Lines:
    """Reads an agent process's JSON lines on a thread, so that its pipe never fills."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[dict[str, Any]] = []
        self._thread = threading.Thread(target=self._read, args=(proc.stdout,), daemon=True)
        self._thread.start()

    def _read(self, pipe: IO[str] | None) -> None:
        for line in pipe or ():
            if line.startswith("{"):
                self.lines.append(json.loads(line))

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


def postgres_pss(postmaster: int) -> int:
    """PostgreSQL's memory: the sum of its processes' PSS (RSS would count shared buffers per backend)."""
    total = 0
    try:
        root = psutil.Process(postmaster)
        for proc in [root, *root.children()]:
            try:
                total += proc.memory_full_info().pss
            except psutil.NoSuchProcess:  # a backend that just ended
                continue
    except psutil.NoSuchProcess:
        return 0
    return total


def store_counts(engine: Any) -> dict[str, Any]:
    """Per kind of agent (the task id's first letter: w = wrap, g = gateway): calls and rollouts."""
    import sqlalchemy as sa

    with engine.connect() as conn:
        calls = conn.execute(sa.text(
            "SELECT substr(r.task_id, 1, 1), count(*), sum(CASE WHEN c.is_training THEN 1 ELSE 0 END) "
            "FROM llm_calls c JOIN rollouts r ON r.id = c.rollout_id GROUP BY 1")).all()
        unattached = conn.execute(sa.text(
            "SELECT count(*) FROM llm_calls c LEFT JOIN rollouts r ON r.id = c.rollout_id WHERE r.id IS NULL"
        )).scalar_one()
        rollouts = conn.execute(sa.text(
            "SELECT substr(task_id, 1, 1), count(*), sum(CASE WHEN status = 'succeeded' THEN 1 ELSE 0 END), "
            "sum(CASE WHEN consumed_step > 0 THEN 1 ELSE 0 END), sum(CASE WHEN consumed_step = -1 THEN 1 ELSE 0 END) "
            "FROM rollouts GROUP BY 1")).all()
        steps = conn.execute(sa.text("SELECT count(*) FROM train_steps")).scalar_one()
    out: dict[str, Any] = {"unattached_calls": unattached, "train_steps": steps}
    for kind, n, training in calls:
        out[f"{kind}_calls"], out[f"{kind}_training_calls"] = n, int(training or 0)
    for kind, n, succeeded, trained, skipped in rollouts:
        out[f"{kind}_rollouts"], out[f"{kind}_succeeded"] = n, int(succeeded or 0)
        out[f"{kind}_trained"], out[f"{kind}_skipped"] = int(trained or 0), int(skipped or 0)
    return out


def failures_in_store(engine: Any, lines_by_kind: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Each kind's failure reasons, and for the gateway agents' failed calls (their URL names the
    rollout) whether the store holds that rollout's calls: a call missing from the store is then
    tied to the exception its agent saw (did the gateway ever read the request?)."""
    import sqlalchemy as sa

    out: dict[str, Any] = {}
    for name, lines in lines_by_kind.items():
        final: dict[str, Any] = next((line for line in reversed(lines) if line.get("final")), {})
        failures = final.get("failures", [])
        rids = sorted({f["url"].split("/")[2] for f in failures if f.get("url", "").startswith("/rollouts/")})
        held: dict[str, int] = {}
        if rids:
            with engine.connect() as conn:
                held = dict(conn.execute(sa.text(
                    "SELECT rollout_id, count(*) FROM llm_calls WHERE rollout_id IN :ids GROUP BY 1"
                ).bindparams(sa.bindparam("ids", expanding=True)), {"ids": rids}).all())
        for f in failures:
            if f.get("url", "").startswith("/rollouts/"):
                f["calls_in_store"] = held.get(f["url"].split("/")[2], 0)  # 2 when the failed call was recorded
        out[name] = {"errors": final.get("errors", {}), "first_failures": failures,
                     "control_retries": final.get("control_retries", {})}
    return out


def anon_mib(pid: int) -> float | None:
    """A process's anonymous resident memory (RssAnon): what a leak grows. RSS also counts file pages
    (the mapped libraries), which the kernel takes back under memory pressure from other programs on
    a shared machine: RSS then falls for every process at once, no matter what they do."""
    try:
        with open(f"/proc/{pid}/status") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))
    except (OSError, StopIteration, ValueError):
        return None
    return kib / 1024 or None  # a zombie reads 0


def sample(procs: dict[str, Any], pg: PostgresTestServer, engine: Any, t0: float) -> dict[str, Any]:
    rss: dict[str, float | None] = {}
    anon: dict[str, float | None] = {}
    for name, proc in procs.items():
        try:
            rss[name] = psutil.Process(proc.pid).memory_info().rss / 2**20
        except psutil.NoSuchProcess:
            rss[name] = None
        anon[name] = anon_mib(proc.pid)
    postmaster = _postmaster_pid(pg)
    rss["postgres"] = postgres_pss(postmaster) / 2**20
    anon["postgres"] = sum(anon_mib(pid) or 0.0 for pid in _pids(postmaster)) or None
    return {"t": time.time() - t0, "rss_mib": rss, "anon_mib": anon, "load": os.getloadavg()[0],
            **store_counts(engine)}


def _pids(root: int) -> list[int]:
    try:
        proc = psutil.Process(root)
        return [root, *(child.pid for child in proc.children())]
    except psutil.NoSuchProcess:
        return []


def _postmaster_pid(pg: PostgresTestServer) -> int:
    with open(os.path.join(pg.datadir, "postmaster.pid")) as f:
        return int(f.readline())


def start_services(args: argparse.Namespace, tmp: Path) -> tuple[PostgresTestServer, LLMTestServer,
                                                                  dict[str, Any], str]:
    pg = PostgresTestServer().start()
    llm = LLMTestServer(latency_ms=args.llm_latency_ms).start()
    port = free_port()
    logs = {name: open(tmp / f"{name}.log", "w") for name in ("gateway", "trainer")}  # noqa: SIM115
    gateway = subprocess.Popen(CLI + ["gateway", "--upstream", llm.base_url, "--store", pg.url, "--port", str(port)],
                               env=ENV, stdout=logs["gateway"], stderr=subprocess.STDOUT)
    gw_url = f"http://127.0.0.1:{port}"
    wait_http(gw_url + "/health", gateway)
    model = save_tiny_model(tmp / "model")
    trainer = subprocess.Popen(CLI + ["trainer", "--store", pg.url, "--model", str(model), "--checkpoints",
                                      str(tmp / "ckpt"), "--group-size", str(GROUP_SIZE), "--groups-per-step",
                                      str(args.groups_per_step), "--lr", "1e-3", "--precision", "fp32"],
                               env=ENV, stdout=logs["trainer"], stderr=subprocess.STDOUT)
    assert llm.pid is not None
    procs: dict[str, Any] = {"gateway": gateway, "trainer": trainer, "llm_server": _Adopted(llm.pid)}
    return pg, llm, procs, gw_url


class _Adopted:
    """A process another object started (the LLM server), sampled like our own Popen children."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def poll(self) -> int | None:
        return None if psutil.pid_exists(self.pid) else 0


def start_agents(args: argparse.Namespace, llm: LLMTestServer, pg: PostgresTestServer,
                 gw_url: str) -> dict[str, tuple[subprocess.Popen[str], Lines]]:
    common = ["--seconds", str(args.minutes * 60), "--think-ms", str(args.think_ms), "--window-s", str(args.window_s)]
    cmds = {"wrap_agents": ["--kind", "wrap", "--llm", llm.base_url, "--store", pg.url,
                            "--agents", str(args.wrap_agents)],
            "gateway_agents": ["--kind", "gateway", "--gateway", gw_url, "--agents", str(args.gateway_agents)]}
    out = {}
    for name, extra in cmds.items():
        proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "bench", "soak_agents.py"), *extra, *common],
                                env=ENV, stdout=subprocess.PIPE, text=True)
        out[name] = (proc, Lines(proc))
    return out


def wait_trainer(engine: Any, trainer: subprocess.Popen[Any], timeout_s: float = 300.0) -> None:
    """Until the trainer holds its lease: torch imported and the model loaded, so that the load does not
    start while it is still starting (on a busy machine that takes a minute, and its steps would come late)."""
    import sqlalchemy as sa

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if trainer.poll() is not None:
            raise RuntimeError(f"the trainer exited with {trainer.returncode} before it started")
        try:
            with engine.connect() as conn:
                if conn.execute(sa.text("SELECT count(*) FROM trainer_leases")).scalar_one():
                    return
        except sa.exc.ProgrammingError:  # the schema is not there yet
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the trainer did not start within {timeout_s:.0f} s")


def drain(engine: Any, trainer: subprocess.Popen[Any], groups_per_step: int, timeout_s: float) -> None:
    """Wait until what is left untrained is less than one step's worth (the trainer waits for a full step)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and trainer.poll() is None:
        c = store_counts(engine)
        waiting = sum(c.get(f"{k}_rollouts", 0) - c.get(f"{k}_trained", 0) - c.get(f"{k}_skipped", 0) for k in "wg")
        if waiting < groups_per_step * GROUP_SIZE:
            return
        time.sleep(1.0)


def stop(proc: Any, timeout: float = 30.0) -> None:
    if isinstance(proc, _Adopted) or proc.poll() is not None:
        return
    proc.send_signal(2)  # SIGINT: the CLIs shut down cleanly on it
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def soak(args: argparse.Namespace) -> dict[str, Any]:
    # Logs, the model and the checkpoints: kept where --workdir says; a temporary folder otherwise,
    # removed after a run that raised nothing and kept (and named) after one that did.
    tmp = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="lightning-soak-"))
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        result = _soak_in(args, tmp)
    except BaseException:
        print(f"the soak's logs are kept in {tmp}", file=sys.stderr)
        raise
    if not args.workdir:
        shutil.rmtree(tmp, ignore_errors=True)
    return result


def _soak_in(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    import sqlalchemy as sa

    from lightning_middleware import TraceStore

    pg, llm, procs, gw_url = start_services(args, tmp)
    engine = sa.create_engine(pg.url, pool_size=1)
    samples: list[dict[str, Any]] = []
    try:
        wait_trainer(engine, procs["trainer"])
        t0 = time.time()
        agents = start_agents(args, llm, pg, gw_url)
        procs.update({name: proc for name, (proc, _lines) in agents.items()})
        while any(proc.poll() is None for proc, _ in agents.values()):
            samples.append(sample(procs, pg, engine, t0))
            for name in ("gateway", "trainer"):
                if procs[name].poll() is not None:
                    raise RuntimeError(f"the {name} exited during the soak: see {tmp / (name + '.log')}")
            time.sleep(args.sample_s)
        agent_s = time.time() - t0
        for proc, lines in agents.values():
            lines.join(30)
            if proc.returncode != 0:
                raise RuntimeError(f"an agent process exited with {proc.returncode}")
        drain(engine, procs["trainer"], args.groups_per_step, args.drain_s)
        samples.append(sample(procs, pg, engine, t0))
        stop(procs["trainer"])
        stop(procs["gateway"])  # its shutdown flushes what it still holds
        final = store_counts(engine)
        store = TraceStore(pg.url)
        trained_ids = [rid for s in store.train_steps() for rid in s.rollout_ids]
        store.close()
        lines_by_kind = {name: lines.lines for name, (_p, lines) in agents.items()}
        failures = failures_in_store(engine, lines_by_kind)
        kinds = {"w": args.wrap_agents, "g": args.gateway_agents}  # agents per task-id prefix (KINDS)
        result = {
            "minutes": args.minutes, "agent_seconds": agent_s, "cpu": _cpu_name(), "cores": os.cpu_count(),
            "wrap_agents": args.wrap_agents, "gateway_agents": args.gateway_agents, "think_ms": args.think_ms,
            "llm_latency_ms": args.llm_latency_ms, "groups_per_step": args.groups_per_step,
            "counts": check_counts(lines_by_kind, final, trained_ids),
            "failures": failures,
            "memory": memory_summary(samples, args.warmup_s, "anon_mib", kinds),
            "memory_rss": memory_summary(samples, args.warmup_s, "rss_mib", kinds),
            "load_avg": {"min": min(s["load"] for s in samples), "max": max(s["load"] for s in samples),
                         "mean": sum(s["load"] for s in samples) / len(samples)},
            "windows": window_rows(lines_by_kind, samples, t0),
            "samples": samples,
        }
    finally:
        for proc in procs.values():
            stop(proc)
        llm.stop()
        engine.dispose()
        pg.destroy()
    return result


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=30.0, help="how long the agents run (then the trainer drains)")
    p.add_argument("--wrap-agents", type=int, default=16)
    p.add_argument("--gateway-agents", type=int, default=16)
    p.add_argument("--think-ms", type=float, default=400.0, help="each agent's pause after each call")
    p.add_argument("--llm-latency-ms", type=float, default=20.0, help="time each completion takes upstream")
    p.add_argument("--groups-per-step", type=int, default=8)
    p.add_argument("--window-s", type=float, default=None, help="table row width (default: the run / 15, >= 5 s)")
    p.add_argument("--sample-s", type=float, default=None, help="memory sampling period (default: window / 3)")
    p.add_argument("--warmup-s", type=float, default=None,
                   help="memory growth is measured from the end of this (default: the first window), and of "
                        "each process's own warm-up (soak_report.warmup_ends)")
    p.add_argument("--drain-s", type=float, default=300.0, help="at most this long for the trainer to catch up")
    p.add_argument("--json", default=None, help="also write the JSON result here")
    p.add_argument("--workdir", default=None,
                   help="the services' logs, model and checkpoints go here (default: a temporary folder, "
                        "removed after a clean run)")
    args = p.parse_args(argv)
    args.window_s = args.window_s or max(5.0, args.minutes * 60 / 15)
    args.sample_s = args.sample_s or max(1.0, args.window_s / 3)
    args.warmup_s = args.window_s if args.warmup_s is None else args.warmup_s
    result = soak(args)
    print_report(result)
    line = json.dumps(result, separators=(",", ":"))
    print(line)
    if args.json:
        Path(args.json).write_text(line + "\n")
    return 0 if result["counts"]["lost"] == 0 and result["counts"]["trained_twice"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
