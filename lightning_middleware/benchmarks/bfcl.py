"""BFCL (the Berkeley Function Calling Leaderboard, PyPI `bfcl-eval`) as tasks, scored by BFCL's
own AST checker, for an agent whose framework turns BFCL's function documents into its own tools.

    bfcl:simple_python?split=train&holdout=0.25&limit=200

names a category, which part of it (`split`: all, train or test; an item is in the test part when
the SHA-256 of its question, read as a fraction, is below `holdout`, so the split is fixed,
documented, the same on every machine, and the same for a question BFCL asks in several
categories), and at most `limit` items in id order. A task is `{"task_id",
"messages", "tools", "bfcl": {"category", "id"}}`: the question's first turn and BFCL's functions
as OpenAI tools, converted by BFCL's own `convert_to_tool` (dots in names become underscores, as
BFCL does for function-calling models). `make_agent` runs it on LangChain with `wrap()`;
`bfcl_score` scores the rollout's first answer with BFCL's `ast_checker`: 1.0 when valid, else
0.0, the checker's `error_type` kept beside it (`no_call` and `malformed_arguments` when there is
nothing to check, `checker_error` when the checker itself fails on an item).

Installed by the set-up with `pip install --no-deps bfcl-eval` (its declared dependencies pull a
CUDA torch and 17 vendor SDKs; the checker needs none of them). Three of its modules import those
SDKs or tree-sitter at import time; where they are missing, stand-ins that hold only what the
checker and the tool conversion read are registered first (`_import_bfcl`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import sys
import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from lightning_middleware.benchmarks.reasoning import BenchmarkError
from lightning_middleware.rewards.rules import Score
from lightning_middleware.rewards.trajectory import Trajectory

SCHEME = "bfcl"
# The single-turn categories BFCL's AST checker scores (the others need execution or several turns).
CATEGORIES = ("simple_python", "multiple", "parallel", "parallel_multiple", "live_simple", "live_multiple",
              "live_parallel", "live_parallel_multiple")
SPLITS = ("all", "train", "test")
DEFAULT_HOLDOUT = 0.25
MODEL_KEY = "lightning/function-calling"  # our entry in BFCL's model table: names with "_" for "."
_EXTRA = "pip install --no-deps 'bfcl-eval>=2026.3.23' (scripts/setup.sh does)"


@dataclass(frozen=True)
class Address:
    category: str
    split: str = "all"
    holdout: float = DEFAULT_HOLDOUT
    limit: int | None = None

    def __str__(self) -> str:
        limit = "" if self.limit is None else f"&limit={self.limit}"
        return f"{SCHEME}:{self.category}?split={self.split}&holdout={self.holdout:g}{limit}"


def parse(address: str) -> Address:
    """`bfcl:CATEGORY?split=...&holdout=...&limit=...` as an Address; BenchmarkError naming the problem."""
    parts = urlsplit(address)
    if parts.scheme != SCHEME or not parts.path:
        raise BenchmarkError(f"a BFCL task address is bfcl:CATEGORY[?split=train|test&holdout=F&limit=N], "
                             f"got {address!r}")
    if parts.path not in CATEGORIES:
        raise BenchmarkError(f"unknown BFCL category {parts.path!r}; the AST-checked ones are {', '.join(CATEGORIES)}")
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    unknown = sorted(set(query) - {"split", "holdout", "limit"})
    if unknown:
        raise BenchmarkError(f"{address!r}: unknown keys {unknown}; known: split, holdout, limit")
    split = query.get("split", "all")
    if split not in SPLITS:
        raise BenchmarkError(f"{address!r}: split is one of {', '.join(SPLITS)}, got {split!r}")
    try:
        holdout = float(query.get("holdout", DEFAULT_HOLDOUT))
        limit = int(query["limit"]) if "limit" in query else None
    except ValueError:
        raise BenchmarkError(f"{address!r}: holdout is a fraction and limit an integer") from None
    if not 0.0 < holdout < 1.0 or (limit is not None and limit <= 0):
        raise BenchmarkError(f"{address!r}: holdout must lie strictly between 0 and 1, limit be positive")
    return Address(parts.path, split, holdout, limit)


def _stand_in(name: str, **attrs: Any) -> None:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    sys.modules[name] = module


@functools.lru_cache(maxsize=1)
def _import_bfcl() -> types.SimpleNamespace:
    """BFCL's checker, tool conversion and data folder, importable without its vendor SDKs."""
    try:
        import bfcl_eval  # noqa: F401
    except ImportError:
        raise BenchmarkError(f"bfcl: task addresses need bfcl-eval: {_EXTRA}") from None
    try:
        from bfcl_eval.constants import model_config
    except ImportError:  # it imports every vendor's SDK; the checker reads one attribute of one entry
        _stand_in("bfcl_eval.constants.model_config", MODEL_CONFIG_MAPPING={})
        from bfcl_eval.constants import model_config
    model_config.MODEL_CONFIG_MAPPING.setdefault(MODEL_KEY, types.SimpleNamespace(underscore_to_dot=True))
    for parser, fn in (("java_parser", "parse_java_function_call"), ("js_parser", "parse_javascript_function_call")):
        name = f"bfcl_eval.model_handler.parser.{parser}"
        try:
            __import__(name)
        except ImportError:  # tree-sitter, for Java and JavaScript items, which are not offered here
            _stand_in(name, **{fn: None})
    from importlib.resources import files

    from bfcl_eval.constants.enums import Language, ModelStyle
    from bfcl_eval.constants.type_mappings import GORILLA_TO_OPENAPI
    from bfcl_eval.eval_checker.ast_eval.ast_checker import ast_checker
    from bfcl_eval.model_handler.utils import convert_to_tool

    def tools(functions: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return list(convert_to_tool(functions, GORILLA_TO_OPENAPI, ModelStyle.OPENAI_COMPLETIONS))

    return types.SimpleNamespace(check=ast_checker, python=Language.PYTHON, tools=tools,
                                 data=files("bfcl_eval") / "data")


def _jsonl(path: Any) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


@functools.lru_cache(maxsize=16)
def items(category: str) -> tuple[dict[str, Any], ...]:
    """A category's items with their possible answers (`item["answer"]`), in BFCL's order."""
    bfcl = _import_bfcl()
    questions = _jsonl(bfcl.data / f"BFCL_v4_{category}.json")
    answers = {a["id"]: a["ground_truth"] for a in _jsonl(bfcl.data / "possible_answer" / f"BFCL_v4_{category}.json")}
    return tuple({**q, "answer": answers[q["id"]]} for q in questions if q["id"] in answers)


def split_key(item: Mapping[str, Any]) -> str:
    """What the split is decided by: the item's user turns. Not its id: BFCL asks the same
    question in several categories (34 of the 140 test items of simple_python and multiple,
    split by id, were asked verbatim in the other's train part), and a held-out question must be
    held out everywhere."""
    return "\n".join(str(m.get("content")) for turn in item["question"] for m in turn if m.get("role") == "user")


def in_test_split(key: str, holdout: float) -> bool:
    """The fixed split: the first 8 bytes of SHA-256(key) as a fraction in [0, 1), below `holdout`."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64 < holdout


def tasks(address: str) -> list[dict[str, Any]]:
    """The items an address names, as tasks."""
    a = parse(address)
    bfcl = _import_bfcl()
    out = []
    for item in items(a.category):
        test = in_test_split(split_key(item), a.holdout)
        if (a.split == "test" and not test) or (a.split == "train" and test):
            continue
        out.append({"task_id": f"bfcl:{item['id']}", "messages": item["question"][0],
                    "tools": bfcl.tools(item["function"]), "bfcl": {"category": a.category, "id": item["id"]}})
        if a.limit is not None and len(out) >= a.limit:
            break
    return out


@functools.lru_cache(maxsize=16)
def _by_id(category: str) -> dict[str, dict[str, Any]]:
    return {item["id"]: item for item in items(category)}


def _task_item(task: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """(category, BFCL's item) of a task `tasks` built; BenchmarkError for any other task."""
    ref = task.get("bfcl")
    if not isinstance(ref, Mapping) or "category" not in ref or "id" not in ref:
        raise BenchmarkError("not a BFCL task: it has no 'bfcl' category and id")
    category = str(ref["category"])
    item = _by_id(category).get(str(ref["id"]))
    if item is None:
        raise BenchmarkError(f"no BFCL item {ref['id']!r} in {category}")
    return category, item


def check(task: Mapping[str, Any], calls: list[tuple[str, dict[str, Any] | None]]) -> Score:
    """BFCL's verdict on the calls (name, parsed arguments or None) answering `task`."""
    category, item = _task_item(task)
    if not calls:
        return Score(0.0, {"valid": False, "error_type": "no_call"})
    if any(args is None for _, args in calls):
        return Score(0.0, {"valid": False, "error_type": "malformed_arguments", "calls": len(calls)})
    bfcl = _import_bfcl()
    output = [{name: args} for name, args in calls]
    try:
        verdict = bfcl.check(item["function"], output, item["answer"], bfcl.python, category,
                             MODEL_KEY.replace("/", "_"))
    except Exception as exc:  # noqa: BLE001 - an item the checker cannot take is counted, never a crash
        return Score(0.0, {"valid": False, "error_type": "checker_error", "error": f"{type(exc).__name__}: {exc}"})
    errors = verdict.get("error") or []
    return Score(float(bool(verdict["valid"])), {"valid": bool(verdict["valid"]),
                                                  "error_type": verdict.get("error_type") if not verdict["valid"]
                                                  else None, "error": str(errors[0])[:300] if errors else None})


def _choice(options: list[Any]) -> Any:
    value = next(o for o in options if o != "")  # "" marks a parameter that may be left out
    if isinstance(value, dict):
        return {k: _choice(v) for k, v in value.items() if any(o != "" for o in v)}
    return value


def reference_calls(task: Mapping[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """One answer BFCL accepts for a task, as (tool name, arguments): each call of its possible
    answer with the first acceptable value of every parameter it gives (what a demonstration for a
    warm start on the train split shows; `check` accepts it)."""
    out = []
    for call in _task_item(task)[1]["answer"]:
        ((name, params),) = call.items()
        args = {k: _choice(v) for k, v in params.items() if any(o != "" for o in v)}
        out.append((name.replace(".", "_"), args))
    return out


def bfcl_score(t: Trajectory) -> Score | None:
    """Reward rule: BFCL's verdict on the tool calls of the rollout's first LLM call (its answer to
    the question); absent when the rollout's task is not a BFCL one."""
    task = t.rollout.input
    if not isinstance(task, Mapping) or "bfcl" not in task:
        return None
    first = min((c.call_index for c in t.calls), default=None)
    calls = [(tc.name, tc.parsed) for tc in t.tool_calls if tc.call_index == first]
    return check(task, calls)


# How far through BFCL's checker an answer got before its first error (the checker tests, in this
# order: the number of calls and the function's name, the parameter names, then each value; an
# optional parameter the answer key requires is reported last, once every value given passed).
STAGES: dict[str, int] = {"wrong_count": 1, "wrong_func_name": 1, "cannot_find_match": 1,
                          "missing_required": 2, "unexpected_param": 2}
PARTIAL_CREDIT = 0.5  # the most an invalid answer earns: a valid one always earns twice as much


def checker_stage(error_type: str | None) -> int:
    """0 (no call, arguments that do not parse, anything the checker could not classify) to 4
    (valid): 1 a call to the wrong function or the wrong number of calls, 2 the right function with
    the wrong parameter names, 3 the right parameters with a wrong value or type."""
    if error_type is None:
        return 4
    kind = error_type.rsplit(":", 1)[-1]
    if error_type.startswith(("type_error:", "value_error:")) or kind == "missing_optional":
        return 3
    return STAGES.get(kind, 0)


def bfcl_stages(t: Trajectory) -> Score | None:
    """Reward rule: `bfcl_score` with partial credit for how far the answer got through BFCL's own
    checker (`checker_stage`): 0, 1/6, 1/3, 1/2 for an invalid answer, 1 for a valid one. BFCL's
    verdict still decides `valid`; the partial credit gives a group of invalid answers a direction
    (a call over none, the right function over a wrong one) where the binary verdict leaves it tied."""
    score = bfcl_score(t)
    if score is None or score.detail.get("valid"):
        return score
    stage = checker_stage(str(score.detail.get("error_type") or "unclear"))
    return Score(PARTIAL_CREDIT * stage / 3, {**score.detail, "stage": stage})


def make_agent(base_url: str, *, model: str, store: Any = None, temperature: float = 0.0,
               max_tokens: int = 256, api_key: str = "-", system: str | None = None) -> Any:
    """An async agent for the controller: LangChain's ChatOpenAI, wrapped, with the task's BFCL
    functions bound as its tools; LangChain parses the model's tool calls. One model turn: BFCL's
    single-turn categories score the first answer. It returns no reward: `bfcl_score`, in the
    reward configuration, scores the rollout. A task's own `temperature` wins over `temperature`.
    `system`: a system message put before the question (BFCL's own function-calling runs send none)."""
    from lightning_middleware.benchmarks.chat import chat_per_loop

    chat = chat_per_loop(base_url, model=model, store=store, api_key=api_key, temperature=temperature,
                         max_tokens=max_tokens)

    async def agent(task: dict[str, Any]) -> None:
        messages = [{"role": "system", "content": system}, *task["messages"]] if system else task["messages"]
        t = float(task.get("temperature", temperature))
        await chat().bind_tools(task["tools"], temperature=t).ainvoke(messages)

    return agent


_env_agents: dict[tuple[str, str], Any] = {}


async def agent(task: dict[str, Any]) -> None:
    """`make_agent` as a module-level agent for `--agent lightning_middleware.benchmarks.bfcl:agent`
    (process, sandboxed or Kubernetes backends): the endpoint from OPENAI_BASE_URL (a sandbox sets
    it to the rollout's door), the model from LIGHTNING_MODEL (default "policy"), the temperature
    from the task's `temperature` (default 0: greedy)."""
    import os

    base_url = os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1")
    key = (base_url, os.environ.get("LIGHTNING_MODEL", "policy"))
    if key not in _env_agents:
        _env_agents[key] = make_agent(key[0], model=key[1],
                                      api_key=os.environ.get("OPENAI_API_KEY", "-"))
    await _env_agents[key](task)

