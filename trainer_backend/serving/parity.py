"""Training and serving checked for parity at run time: the served model must tokenise and template a
conversation exactly as the trainer does, or the trainer's rows are not what was sampled.

`TemplateParity(model_dir, server_url).check()` asks the vLLM server to render probe conversations
(with tools, a multi-turn tool history, and a system prompt) through `/tokenize`, and compares them
with the trainer's `apply_chat_template` of the same ones; it also checks that every special token
is one and the same ID on both sides, and that the vocabulary ends at the same ID. It also checks
that the server serves the same model: where the server's model (`/v1/models` `root`) is a folder on
this machine, its config must agree with the trainer's on what fixes the weights' shapes and meaning
(`IDENTITY_KEYS`): the same tokenizer in front of another model passes every probe, and its
log-prob ratios are noise. Weights differ by design (the trainer publishes its own). `require()`
refuses a mismatch (`TemplateMismatch`, one line naming the first differing token with both
decodings) unless `allow_mismatch` was given.

`render_request` is the trainer's side of that comparison, normalised as vLLM 0.32 normalises a chat
request before templating it: a tool call's JSON arguments become a dict, a list of text parts
becomes one string joined by newlines.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from lightning_middleware.errors import UsageError

log = logging.getLogger(__name__)

ALLOW_FLAG = "--allow-template-mismatch"
RISK = ("the trainer then trains on token IDs the server never sampled from: prefix merges break, "
        "log-prob ratios are wrong, and the update can degrade the policy silently")

_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
PROBES: dict[str, dict[str, Any]] = {
    "plain": {"messages": [{"role": "user", "content": "What is 2 + 3?"}]},
    "system_and_history": {"messages": [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris"},
        {"role": "user", "content": "And of Italy?"}]},
    "tool_history": {"tools": [_WEATHER], "messages": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Oslo"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C, snow"},
        {"role": "user", "content": "Thanks. Is that cold?"}]},
    "text_parts": {"messages": [{"role": "user", "content": [{"type": "text", "text": "first part"},
                                                            {"type": "text", "text": "second part"}]}]},
}


# What makes two configs the same model for training (its size, its wiring, its vocabulary).
IDENTITY_KEYS = ("model_type", "architectures", "hidden_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "intermediate_size", "vocab_size", "tie_word_embeddings")


def model_identity(served_root: str, model_dir: str | Path) -> tuple[list[str], str]:
    """(problems, what was compared) between the config of the model a server loaded from
    `served_root` and the trainer's `model_dir`. A root that is no folder here (a hub ID, another
    machine's path) is not compared, and the second value says so."""
    served, trainer = Path(served_root), Path(model_dir)
    if not (served / "config.json").is_file():
        return [], f"not compared: the server's model {served_root!r} is no folder with a config.json here"
    if not (trainer / "config.json").is_file():
        return [], f"not compared: the trainer's model {str(model_dir)!r} has no config.json"
    a, b = (json.loads((d / "config.json").read_text()) for d in (served, trainer))
    keys = [k for k in IDENTITY_KEYS if k in a and k in b]  # a field one side leaves to its default: not compared
    problems = [f"the server's model {served_root} has {k}={a.get(k)!r}, the trainer's {model_dir} {b.get(k)!r}"
                for k in keys if a.get(k) != b.get(k)]
    return problems, f"config of {served_root}: {len(keys)} fields compared"


class TemplateMismatch(UsageError):
    """The served model renders or tokenises differently from the trainer's tokenizer."""


class ParityUnavailable(Exception):
    """The server cannot be asked (unreachable, or no vLLM `/tokenize`): nothing was compared."""


def normalise_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as vLLM hands them to the chat template."""
    out = []
    for m in messages:
        msg = dict(m)
        content = msg.get("content")
        if isinstance(content, list) and all(isinstance(p, Mapping) and p.get("type") == "text" for p in content):
            msg["content"] = "\n".join(str(p.get("text", "")) for p in content)
        if msg.get("tool_calls"):
            msg["tool_calls"] = [_with_dict_arguments(tc) for tc in msg["tool_calls"]]
        elif "tool_calls" in msg:
            del msg["tool_calls"]  # an empty list renders as no calls on the server
        out.append(msg)
    return out


def _with_dict_arguments(tool_call: Mapping[str, Any]) -> dict[str, Any]:
    tc = dict(tool_call)
    fn = dict(tc.get("function") or {})
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            fn["arguments"] = json.loads(args)
        except json.JSONDecodeError:
            pass  # vLLM leaves what is not JSON as it is
    tc["function"] = fn
    return tc


def render_request(tokenizer: Any, request: Mapping[str, Any]) -> list[int]:
    """The prompt IDs the trainer's tokenizer gives a chat request (`messages`, optional `tools`,
    `chat_template_kwargs`, `add_generation_prompt`, `continue_final_message`)."""
    continue_final = bool(request.get("continue_final_message", False))
    ids = tokenizer.apply_chat_template(
        normalise_messages(request["messages"]), tools=request.get("tools") or None, tokenize=True,
        add_generation_prompt=bool(request.get("add_generation_prompt", not continue_final)),
        continue_final_message=continue_final, **dict(request.get("chat_template_kwargs") or {}))
    if isinstance(ids, Mapping) or hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return [int(i) for i in ids]


@dataclass(frozen=True)
class Difference:
    """Where the two sides first part: `index` into the token lists, and the IDs there (None past an end)."""

    probe: str
    index: int
    server: int | None
    trainer: int | None
    server_text: str
    trainer_text: str
    lengths: tuple[int, int]

    def describe(self) -> str:
        def side(i: int | None, text: str) -> str:
            return "(end)" if i is None else f"{i} {text!r}"

        return (f"probe {self.probe!r}: first difference at token {self.index} (server {self.lengths[0]} tokens, "
                f"trainer {self.lengths[1]}): server {side(self.server, self.server_text)}, "
                f"trainer {side(self.trainer, self.trainer_text)}")


@dataclass(frozen=True)
class ParityReport:
    server_url: str
    model_dir: str
    served: Mapping[str, Any] = field(default_factory=dict)  # the server's /v1/models entry
    probes_checked: int = 0
    special_tokens_checked: int = 0
    differences: tuple[Difference, ...] = ()
    problems: tuple[str, ...] = ()  # model identity, vocabulary and special-token findings
    unavailable: str | None = None  # why nothing could be compared (then `ok`: nothing found)
    identity: str = ""  # what the model identity check compared (`model_identity`)

    @property
    def ok(self) -> bool:
        return not self.differences and not self.problems

    def message(self, when: str) -> str:
        what = [d.describe() for d in self.differences[:1]] + list(self.problems[:2])
        more = len(self.differences) + len(self.problems) - len(what)
        return (f"the served model at {self.server_url} does not match the trainer's {self.model_dir} "
                f"({when}): " + "; ".join(what) + (f"; and {more} more" if more > 0 else "")
                + f". Serve the trainer's tokenizer and chat template, or pass {ALLOW_FLAG} ({RISK})")


class TemplateParity:
    """The served model against the trainer's tokenizer (`model_dir`), through vLLM's `/tokenize`."""

    def __init__(self, model_dir: str | Path, server_url: str, *, allow_mismatch: bool = False,
                 timeout_s: float = 30.0, transport: httpx.BaseTransport | None = None,
                 tokenizer: Any | None = None) -> None:
        from transformers import AutoTokenizer

        self.model_dir = str(model_dir)
        self.root = server_url.rstrip("/").removesuffix("/v1")
        self.allow_mismatch = allow_mismatch
        self.tokenizer = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(self.model_dir)
        self._http = httpx.Client(timeout=timeout_s, transport=transport)
        self.last: ParityReport | None = None

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> TemplateParity:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def check(self) -> ParityReport:
        served = self._served_model()
        model = str(served.get("id", ""))
        differences = []
        for name, probe in PROBES.items():
            server = self._post("/tokenize", {"model": model, "add_generation_prompt": True, **probe})["tokens"]
            trainer = render_request(self.tokenizer, {"add_generation_prompt": True, **probe})
            d = self._first_difference(name, [int(t) for t in server], trainer)
            if d is not None:
                differences.append(d)
        special = self._special_ids()
        mismatched, identity = model_identity(str(served.get("root") or ""), self.model_dir)
        problems = mismatched + self._special_tokens(model, special) + self._vocabulary_end(model)
        self.last = ParityReport(self.root, self.model_dir, served, len(PROBES), len(special),
                                 tuple(differences), tuple(problems), identity=identity)
        return self.last

    def require(self, when: str) -> ParityReport:
        """`check()`, raising `TemplateMismatch` on a mismatch unless mismatches are allowed (then a warning)."""
        try:
            report = self.check()
        except ParityUnavailable as exc:
            log.warning("the served model's chat template is not checked %s: %s", when, exc)
            return ParityReport(self.root, self.model_dir, unavailable=str(exc))
        if not report.ok:
            if not self.allow_mismatch:
                raise TemplateMismatch(report.message(when))
            log.warning("%s (allowed by %s)", report.message(when), ALLOW_FLAG)
        return report

    # -- the pieces -------------------------------------------------------------
    def _served_model(self) -> dict[str, Any]:
        models = self._get("/v1/models").get("data") or []
        base = [m for m in models if not m.get("parent")]  # LoRA adapters name their base as parent
        if not base:
            raise ParityUnavailable(f"the server at {self.root} lists no model on /v1/models")
        return dict(base[0])

    def _first_difference(self, probe: str, server: list[int], trainer: list[int]) -> Difference | None:
        if server == trainer:
            return None
        i = next((k for k, (a, b) in enumerate(zip(server, trainer)) if a != b), min(len(server), len(trainer)))
        s = server[i] if i < len(server) else None
        t = trainer[i] if i < len(trainer) else None
        return Difference(probe, i, s, t, self._decode(s), self._decode(t), (len(server), len(trainer)))

    def _decode(self, token: int | None) -> str:
        return "" if token is None else str(self.tokenizer.decode([token]))

    def _special_ids(self) -> dict[str, int]:
        tok = self.tokenizer
        names = set(tok.all_special_tokens) | {str(t) for t in getattr(tok, "added_tokens_decoder", {}).values()}
        ids = {n: tok.convert_tokens_to_ids(n) for n in sorted(names)}
        return {n: int(i) for n, i in ids.items() if isinstance(i, int)}

    def _special_tokens(self, model: str, special: Mapping[str, int]) -> list[str]:
        problems = []
        for text, want in special.items():
            got = self._post("/tokenize", {"model": model, "prompt": text, "add_special_tokens": False})["tokens"]
            if list(got) != [want]:
                problems.append(f"special token {text!r} is {want} for the trainer, {list(got)} on the server")
        return problems

    def _vocabulary_end(self, model: str) -> list[str]:
        """The server decodes the trainer's last token ID as the trainer does."""
        last = len(self.tokenizer) - 1
        resp = self._http.post(self.root + "/detokenize", json={"model": model, "tokens": [last]})
        if resp.status_code != 200:
            return [f"the server cannot decode token {last}, the last of the trainer's vocabulary "
                    f"({len(self.tokenizer)} tokens)"]
        got, want = resp.json().get("prompt", ""), self.tokenizer.decode([last])
        return [] if got == want else [f"token {last} decodes as {got!r} on the server, {want!r} for the trainer"]

    def _get(self, path: str) -> dict[str, Any]:
        return self._ask("GET", path, None)

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._ask("POST", path, body)

    def _ask(self, method: str, path: str, body: dict[str, Any] | None) -> dict[str, Any]:
        try:
            resp = self._http.request(method, self.root + path, json=body)
        except httpx.HTTPError as exc:
            raise ParityUnavailable(f"the server at {self.root} did not answer {path} "
                                    f"({type(exc).__name__}: {exc})") from None
        if resp.status_code != 200:
            raise ParityUnavailable(f"the server at {self.root} answered {path} with {resp.status_code} "
                                    f"({resp.text[:200]}): not a vLLM server?")
        out: dict[str, Any] = resp.json()
        return out
