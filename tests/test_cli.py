"""Every command answers a bad input with one line that names it, a non-zero exit, no traceback."""

from __future__ import annotations

import argparse
import subprocess
import sys
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path

import pytest

from lightning_middleware.cli import build_parser
from lightning_middleware.errors import UsageError

ROOT = Path(__file__).resolve().parent.parent


def _run(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lightning_middleware.cli", *argv], capture_output=True, text=True,
                          timeout=120, cwd=cwd or ROOT)


def _one_line(proc: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-500:], proc.stderr[-2000:])
    err = proc.stderr.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    for fragment in fragments:
        assert fragment in err, err


@pytest.mark.parametrize("argv", [["inspect"], ["rollouts", "metrics"], ["export", "--out", "-"]])
def test_a_store_in_a_missing_directory(argv: list[str], tmp_path: Path) -> None:
    _one_line(_run(*argv, "--store", f"sqlite:///{tmp_path}/missing/dir.db"), "does not exist")


def test_a_bad_store_url() -> None:
    _one_line(_run("inspect", "--store", "mysql://db/x"), "unsupported store engine")


def test_an_agent_that_cannot_be_imported(tmp_path: Path) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"task_id": "a"}\n')
    store = f"sqlite:///{tmp_path / 'x.db'}"
    _one_line(_run("rollouts", "run", "--agent", "nosuch:fn", "--tasks", str(tasks), "--store", store),
              "cannot import the agent 'nosuch:fn'", "No module named 'nosuch'")
    _one_line(_run("rollouts", "run", "--agent", "json:nosuch", "--tasks", str(tasks), "--store", store),
              "module 'json' has no 'nosuch'")


def test_a_missing_or_malformed_task_file(tmp_path: Path) -> None:
    store = f"sqlite:///{tmp_path / 'x.db'}"
    agent = "tests.controller.controller_agents:tool_agent"
    _one_line(_run("rollouts", "run", "--agent", agent, "--tasks", str(tmp_path / "none.jsonl"), "--store", store),
              "cannot read the task file", "none.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"task_id": "a"}\n{oops\n')
    _one_line(_run("rollouts", "run", "--agent", agent, "--tasks", str(bad), "--store", store),
              "bad.jsonl, line 2: not JSON")
    dup = tmp_path / "dup.jsonl"
    dup.write_text('{"task_id": "a"}\n{"task_id": "a"}\n')
    _one_line(_run("rollouts", "run", "--agent", agent, "--tasks", str(dup), "--store", store), "duplicate task id")


def test_the_trainer_with_a_missing_model_or_a_bad_config(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    store = f"sqlite:///{tmp_path / 'x.db'}"
    _one_line(_run("trainer", "--store", store, "--model", "/nonexistent"), "run.model: no model folder")
    bad = tmp_path / "trainer.toml"
    bad.write_text("[loss]\nclip_low = 2\n")
    proc = _run("trainer", "--config", str(bad), "--store", store, "--model", str(tmp_path))
    assert proc.returncode == 2 and "loss.clip_low" in proc.stderr and "Traceback" not in proc.stderr


def _ghost_commands(tmp_path: Path) -> list[EntryPoint]:
    """Two commands whose modules cannot be imported: one needs a package that is not installed,
    one is a module of its own package that imports a name it does not have (a bug)."""
    pkg = tmp_path / "ghostpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "needs_dep.py").write_text("import no_such_dependency_xyz\n\ndef add_cli(sub):\n    pass\n")
    (pkg / "broken.py").write_text("from ghostpkg import no_such_name\n\ndef add_cli(sub):\n    pass\n")
    group = "lightning_middleware.commands"
    return [EntryPoint("optional", "ghostpkg.needs_dep:add_cli", group),
            EntryPoint("broken", "ghostpkg.broken:add_cli", group)]


def test_a_command_that_cannot_be_imported_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    parser = build_parser(_ghost_commands(tmp_path))
    # Listed in the help, not vanished, each with its reason.
    helptext = parser.format_help()
    assert "optional" in helptext and "broken" in helptext
    # The missing dependency is expected (debug only); the broken import of its own package is a warning.
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "broken" in warnings[0] and "no_such_name" in warnings[0], warnings
    for name, fragment in (("optional", "needs the package 'no_such_dependency_xyz'"),
                           ("broken", "failed to import (ImportError")):
        args = parser.parse_args([name, "--any", "-x", "flags"])
        with pytest.raises(UsageError, match="unavailable: ") as exc:
            args.func(args)  # the dispatcher prints a UsageError as one line and exits 2 (tests above)
        assert fragment in str(exc.value), exc.value


def test_export_to_a_missing_directory_is_one_line(tmp_path: Path) -> None:
    """Not argparse's usage block: the output's folder named on one line."""
    store = f"sqlite:///{tmp_path / 'x.db'}"
    _one_line(_run("export", "--store", store, "--out", "/nonexistent/dir/x.jsonl"),
              "lightning-mw export:", "/nonexistent/dir does not exist")
    _one_line(_run("export", "--store", store, "--out", str(tmp_path / "y.jsonl"), "--policy-version", "1",
                   "--min-policy-version", "0"), "can't be combined")


def test_the_gateway_with_a_bad_upstream_or_a_taken_port(tmp_path: Path) -> None:
    import socket

    store = f"sqlite:///{tmp_path / 'x.db'}"
    _one_line(_run("gateway", "--upstream", "not-a-url", "--store", store),
              "lightning-mw gateway:", "upstream must be an http(s) URL, got 'not-a-url'")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        _one_line(_run("gateway", "--upstream", "http://127.0.0.1:9/v1", "--store", store, "--port", str(port)),
                  "lightning-mw gateway:", f"can't listen on 127.0.0.1:{port}")


def test_serve_a_folder_that_is_not_a_model(tmp_path: Path) -> None:
    """Checked before vLLM starts (a minute of loading, then a traceback, before)."""
    _one_line(_run("serve", "/nonexistent"), "lightning-mw serve:", "no model folder at /nonexistent")
    (tmp_path / "empty").mkdir()
    _one_line(_run("serve", str(tmp_path / "empty")), "no config.json")


@pytest.mark.vllm
def test_serve_says_in_one_line_that_vllm_did_not_start(vllm_python: Path, tied_checkpoints, tmp_path: Path) -> None:
    """A start failure (here a flag vLLM does not know) names the server's log instead of a traceback."""
    log = tmp_path / "vllm.log"
    proc = _run("serve", str(tied_checkpoints.base), "--vllm-args=--no-such-vllm-flag", "--log-path", str(log))
    # the command logs the start as it always does; the failure is then one line, the last
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("lightning-mw serve: vLLM did not start: vLLM exited with code 2") and \
        last.endswith(f"(log {log})"), proc.stderr[-3000:]
    assert "no-such-vllm-flag" in log.read_text(), log.read_text()[-2000:]


def test_a_named_command_loads_its_entry_point_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    ghosts = _ghost_commands(tmp_path)
    (tmp_path / "cheap_command_xyz.py").write_text(  # a module of its own: ghostpkg may be cached from elsewhere
        "def add_cli(sub):\n    p = sub.add_parser('cheap')\n    p.add_argument('--n', type=int)\n"
        "    p.set_defaults(func=lambda args: args.n)\n")
    commands = [EntryPoint("cheap", "cheap_command_xyz:add_cli", "lightning_middleware.commands"), *ghosts]
    for argv in (["cheap", "--n", "3"], ["-v", "cheap", "--n", "3"]):
        parser = build_parser(commands, argv=argv)
        args = parser.parse_args(argv)
        assert args.func(args) == 3
        assert "optional" not in parser.format_help()  # the others were never imported
    # no command, an option first, or a name no entry point has: every command, to list or to refuse
    for argv in ([], ["--help"], ["chea"]):
        assert "optional" in build_parser(commands, argv=argv).format_help(), argv


def test_every_command_is_registered_under_its_entry_points_name() -> None:
    """What loading the named entry point alone relies on; the extra names (`vllm-env`) load them all."""
    for ep in entry_points(group="lightning_middleware.commands"):
        sub = argparse.ArgumentParser().add_subparsers()
        ep.load()(sub)
        assert ep.name in sub.choices, (ep.name, sorted(sub.choices))


def test_a_rollout_workers_command_line_imports_nothing_of_the_trainer() -> None:
    code = ("import sys\nfrom lightning_middleware.cli import main\ntry:\n    main(['rollouts', 'worker', '--help'])\n"
            "except SystemExit:\n    pass\nprint(sorted(m for m in sys.modules if m.startswith('trainer_backend')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout[-2000:]
    assert "worker" in proc.stdout  # the help was printed: the command was there
