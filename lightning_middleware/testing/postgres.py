"""A throwaway PostgreSQL server for tests and benchmarks (the Debian `postgresql` package)."""

from __future__ import annotations

import os
import subprocess
from typing import Any

from lightning_middleware.testing.llm_server import free_port


class PostgresTestServer:
    """A throwaway PostgreSQL cluster on loopback, from the Debian `postgresql` package.

    Runs as the `postgres` user when we are root (PostgreSQL refuses root).
    `stop()` / `start()` keep the data directory, so tests can take the database
    away mid-run and bring it back.
    """

    def __init__(self, *, port: int | None = None, durable: bool = False) -> None:
        import glob
        import shutil
        import tempfile

        found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
        bindir = os.path.dirname(found[-1]) if found else os.path.dirname(shutil.which("initdb") or "")
        if not bindir:
            raise RuntimeError("PostgreSQL server binaries not found: apt-get install postgresql")
        self.bindir = bindir
        self.port = port or free_port()
        self.durable = durable
        self.root = tempfile.mkdtemp(prefix="lightning-pg-")
        self.datadir = os.path.join(self.root, "data")
        self.url = f"postgresql+psycopg://lightning@127.0.0.1:{self.port}/lightning_test"
        self._initialised = False

    def _run(self, *args: str) -> None:
        cmd = [os.path.join(self.bindir, args[0]), *args[1:]]
        if os.geteuid() == 0:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{args[0]} failed: {proc.stderr.strip() or proc.stdout.strip()}")

    def start(self) -> PostgresTestServer:
        if not self._initialised:
            if os.geteuid() == 0:
                import shutil

                shutil.chown(self.root, "postgres", "postgres")
            self._run("initdb", "-D", self.datadir, "-U", "lightning", "--auth=trust", "-E", "UTF8", "--no-sync")
        opts = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c max_connections=200"
        if not self.durable:
            opts += " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        self._run("pg_ctl", "-D", self.datadir, "-o", opts, "-l", os.path.join(self.root, "log"), "-w", "start")
        if not self._initialised:
            self._run("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", "lightning", "lightning_test")
            self._initialised = True
        return self

    def stop(self) -> None:
        self._run("pg_ctl", "-D", self.datadir, "-m", "fast", "-w", "stop")

    def destroy(self) -> None:
        import shutil

        try:
            self.stop()
        except RuntimeError:
            pass
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> PostgresTestServer:
        return self.start()

    def __exit__(self, *_exc: Any) -> None:
        self.destroy()
