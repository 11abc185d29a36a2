"""Which tests share a pytest-xdist worker, which belong to the quick tier, and the check that the
grouping took effect (a pytest plugin module: the root conftest loads it).

Each test gets the markers of what it needs, so that one expression selects a tier:
- `vllm`: it starts a vLLM CPU server (it asks for the `vllm_python` fixture, or says so itself);
- `demo`: one of the demo runs (DEMOS), the longest tests by far;
- `browser`: it drives headless Chromium (the tests say so themselves).
`bash scripts/test.sh --quick` deselects all three (QUICK): the tier to run while working.

scripts/test.sh runs `-n 2 --dist loadgroup --no-loadscope-reorder`; each worker is a pytest
session of its own, so a session fixture (a server) starts once per worker that runs a test
asking for it. Kept on one worker, each group in GROUPS: the tests that share the tiny model's vLLM
server (it starts once), those of Ray's local runtime (two workers would start it on one port),
the SmolLM2 demos and the tiny model's demos, each pair one after another (each demo keeps both
cores busy with its own vLLM server and trainer); and the tests of a module that share a
module-scoped fixture (group_of). The SmolLM2 demos come first in the collection, and without
xdist's reordering of groups by size their group is the first work unit handed out: it is the
suite's longest, so it starts at once and the other worker takes the rest. The tiny model's demos
come last, so the worker that runs out of other work first takes them.

`--dist loadgroup` groups by a suffix xdist appends to each grouped test's id (`NODEID@group`).
With pytest 9.2 and pytest-xdist 3.8 that suffix is lost (xdist writes `item._nodeid`, pytest 9.2
keeps the id in `item._id`) and the tests spread over both workers with no error; pyproject.toml
pins pytest below 9.2. So a worker checks, once collected, that every grouped test's id carries its
group, and stops the run on one line if not; tests/test_workers.py runs a planted suite on two
workers and checks where its grouped tests ran.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

DEMOS = ("tests/demo/test_smol_bfcl.py::test_short_bfcl_demo_learns",
         "tests/demo/test_smol_demo.py::test_short_smol_demo_learns",
         "tests/demo/test_team_demo.py::test_short_team_demo_trains_each_role_on_its_own_adapter",
         "tests/demo/test_demo.py::test_short_demo_learns")  # longest first
# The SmolLM2 demos open the collection, one group; the tiny model's close it, another: the worker
# that runs out of other tests first takes them (on 2 AVX2 cores the SmolLM2 lane alone is ~46 min,
# and the other worker ran out ~19 min before the lane's end; docs/benchmarks.md).
SMOL_DEMOS, TINY_DEMOS = DEMOS[:2], DEMOS[2:]
QUICK = "not vllm and not demo and not browser"
GROUPS: tuple[tuple[str, Callable[[pytest.Item], bool]], ...] = (
    ("demo", lambda item: item.nodeid in SMOL_DEMOS),
    ("demo-tiny", lambda item: item.nodeid in TINY_DEMOS),
    ("vllm", lambda item: "vllm_server" in getattr(item, "fixturenames", ())),
    ("ray", lambda item: item.nodeid.startswith("tests/controller/test_controller_ray")),
)


# Module-scoped fixtures cheap enough to build on every worker (a tiny model saved in well under a
# second): they do not group their module. Grouped, the trainer modules that ask for them ran one
# after another on one worker, the quick tier's last minute on one core (docs/benchmarks.md).
PER_WORKER = frozenset({"model_dir", "ref_dir", "bytes_model"})


def _module_scoped(item: pytest.Item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    return info is not None and any(defs and defs[-1].scope == "module" and name not in PER_WORKER
                                    for name, defs in info.name2fixturedefs.items())


def group_of(item: pytest.Item) -> str | None:
    """The worker group a test runs in, if any: one of GROUPS, else its module's where it asks for a
    module-scoped fixture (one runs once per worker that runs the module's tests: a LoRA vLLM server,
    a verl subprocess of ~15 s of CPU, a gateway), unless it is one of PER_WORKER."""
    for group, wants in GROUPS:
        if wants(item):
            return group
    return item.nodeid.partition("::")[0] if _module_scoped(item) else None


@pytest.hookimpl(tryfirst=True)  # before xdist's, which turns the group markers into id suffixes
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid in DEMOS:  # no `@group` suffix yet: this runs before xdist's hook
            item.add_marker(pytest.mark.demo)
        if "vllm_python" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.vllm)
        if (group := group_of(item)) is not None:
            item.add_marker(pytest.mark.xdist_group(group))
    rank = {**{nodeid: i - len(SMOL_DEMOS) for i, nodeid in enumerate(SMOL_DEMOS)},
            **{nodeid: i + 1 for i, nodeid in enumerate(TINY_DEMOS)}}
    items.sort(key=lambda item: rank.get(item.nodeid, 0))  # stable: the rest keep their order, between


def ungrouped(items: list[pytest.Item]) -> list[str]:
    """The ids of grouped tests whose id lacks the `@group` suffix loadgroup schedules by."""
    lost = []
    for item in items:
        names = sorted({m.kwargs.get("name", m.args[0] if m.args else "default")
                        for m in item.iter_markers("xdist_group")})
        if names and not item.nodeid.endswith("@" + "_".join(names)):
            lost.append(item.nodeid)
    return lost


def pytest_collection_finish(session: pytest.Session) -> None:
    if not getattr(session.config.option, "loadgroup", False):  # what xdist sets on a worker
        return
    if lost := ungrouped(session.items):
        # An exception here would end the worker with no word to the controller; a worker's
        # shouldstop reaches it, and it stops the run with this line ("Interrupted: ...").
        session.shouldstop = (
            f"--dist loadgroup did not group {len(lost)} tests (first: {lost[0]}): this pytest "
            f"({pytest.__version__}) and pytest-xdist drop the group from the test id; "
            "use the versions pyproject.toml pins (bash scripts/setup.sh)")
