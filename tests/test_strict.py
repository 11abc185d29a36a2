"""tests/strict.py: where the run asks for every test, a skip for a missing module fails."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.planted import run_pytest

MODULE_LEVEL = "import pytest\nmissing = pytest.importorskip('no_such_module_xyz')\n\ndef test_a():\n    pass\n"
IN_A_TEST = ("import pytest\n\ndef test_b():\n    pytest.importorskip('no_such_module_xyz')\n\n"
             "def test_c():\n    pytest.skip('no cluster here')\n")


def _pytest(folder: Path, require_all: bool) -> subprocess.CompletedProcess[str]:
    env = {"LIGHTNING_TEST_REQUIRE_ALL": "1"} if require_all else {}
    return run_pytest(folder, "-rA", "-p", "tests.strict", env=env, timeout=120)


def test_a_missing_module_skips_by_default_and_fails_where_everything_is_required(tmp_path: Path) -> None:
    (tmp_path / "in_test").mkdir()
    (tmp_path / "in_test" / "test_in_a_test.py").write_text(IN_A_TEST)
    (tmp_path / "module").mkdir()
    (tmp_path / "module" / "test_module_level.py").write_text(MODULE_LEVEL)
    for folder, skipped in (("in_test", "2 skipped"), ("module", "1 skipped")):
        relaxed = _pytest(tmp_path / folder, require_all=False)
        assert relaxed.returncode in (0, 5) and skipped in relaxed.stdout, relaxed.stdout[-2000:]  # 5: no test ran
    # in a test: it fails, naming the module and the set-up; a skip for another reason stays a skip
    strict = _pytest(tmp_path / "in_test", require_all=True)
    out = strict.stdout
    assert strict.returncode == 1 and "1 failed, 1 skipped" in out, out[-3000:]
    assert "could not import 'no_such_module_xyz'" in out and "bash scripts/setup.sh" in out, out[-3000:]
    # at a module's import: a collection error, which stops the run before any test
    strict = _pytest(tmp_path / "module", require_all=True)
    out = strict.stdout
    assert strict.returncode == 2 and "1 error" in out and "could not import 'no_such_module_xyz'" in out, out[-3000:]
