"""A readable account of one rollout: the messages, each reply with the tokens the trainer
trains on marked, failed attempts and rewards (`transcript(store, rollout_id)`)."""

from __future__ import annotations

import html as _html
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_middleware.records import LLMCall, Rollout
from lightning_middleware.rows import build_rows
from lightning_middleware.store import TraceStore, open_store


def trained_spans(calls: Sequence[LLMCall], *, rollout_id: str = "", max_len: int | None = None
                  ) -> dict[str, tuple[int, int]]:
    """For each call id: (trained completion tokens, completion tokens), as the trainer builds rows.

    A call the trainer skips (failed, partial, not training, superseded attempt) maps to (0, n);
    truncation at `max_len` cuts the trained count of the calls at the end of a row. For a call
    with several choices (`n` > 1) the counts are of the choice trained.
    """
    return _trained(calls, rollout_id, max_len)[0]


def _trained(calls: Sequence[LLMCall], rollout_id: str, max_len: int | None
             ) -> tuple[dict[str, tuple[int, int]], dict[str, int]]:
    """(`trained_spans`, per trained call the index of the choice trained) from one row build."""
    rows, _ = build_rows(list(calls), rollout_id=rollout_id, max_len=max_len)
    by_id = {c.id: c for c in calls}
    spans = {c.id: (0, len(c.completion_token_ids)) for c in calls}
    chosen: dict[str, int] = {}
    for row in rows:
        for cid, index in zip(row.call_ids, row.choices):
            c = by_id[cid]
            n = len(c.choice(index).completion_token_ids)
            start = len(c.prompt_token_ids)  # the prompt is a prefix of the row, so the completion starts here
            trained = sum(row.loss_mask[start:min(start + n, len(row))]) if start < len(row) else 0
            spans[cid], chosen[cid] = (trained, n), index
    return spans, chosen


# --------------------------------------------------------------------------
# Transcript
# --------------------------------------------------------------------------

@dataclass
class TranscriptEntry:
    """One line of a transcript: a message the agent sent, a reply, a failed attempt, or a reward."""

    kind: str  # "header" | "call" | "message" | "reply" | "attempt" | "reward"
    text: str
    role: str | None = None
    trained: tuple[int, int] | None = None  # (trained tokens, completion tokens) for replies
    call_index: int | None = None


@dataclass
class Transcript:
    """A readable account of one rollout; `text()` for a terminal, `html()` (and notebook display)
    marks the trained reply tokens."""

    rollout: Rollout
    entries: list[TranscriptEntry] = field(default_factory=list)

    def text(self) -> str:
        lines = []
        for e in self.entries:
            if e.kind == "header":
                lines.append(f"=== {e.text}")
            elif e.kind in ("call", "attempt"):
                lines.append(f"--- {e.text}")
            elif e.kind == "reward":
                lines.append(f"*** reward {e.text}")
            elif e.kind == "reply":
                k, n = e.trained or (0, 0)
                tag = "trained" if n and k == n else (f"trained {k}/{n} tokens" if k else "not trained")
                lines.append(f"[{e.role}] <<{tag}>> {e.text}")
            else:
                lines.append(f"[{e.role}] {e.text}")
        return "\n".join(lines)

    def html(self) -> str:
        parts = ['<div class="lmw-transcript" style="font-family:monospace;white-space:pre-wrap">']
        for e in self.entries:
            t = _html.escape(e.text)
            if e.kind == "header":
                parts.append(f"<h4>{t}</h4>")
            elif e.kind in ("call", "attempt"):
                parts.append(f'<div style="color:#666;border-top:1px solid #ddd">{t}</div>')
            elif e.kind == "reward":
                parts.append(f"<div><b>reward</b> {t}</div>")
            elif e.kind == "reply":
                k, n = e.trained or (0, 0)
                title = f"{k}/{n} completion tokens trained"
                if k and k == n:
                    body = f'<mark class="trained" title="{title}">{t}</mark>'
                elif k:
                    body = f'<mark class="trained partly" title="{title}" style="background:#fe9">{t}</mark>'
                else:
                    body = f'<span class="untrained" title="{title}">{t}</span>'
                parts.append(f"<div><b>[{_html.escape(e.role or '')}]</b> {body}</div>")
            else:
                parts.append(f"<div><b>[{_html.escape(e.role or '')}]</b> {t}</div>")
        parts.append("</div>")
        return "\n".join(parts)

    def _repr_html_(self) -> str:
        return self.html()

    def __str__(self) -> str:
        return self.text()


def _content_text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return "" if content is None else str(content)


def _message_text(m: dict[str, Any]) -> str:
    text = _content_text(m.get("content"))
    for tc in m.get("tool_calls") or []:
        fn = tc.get("function") or {}
        text += f"{' ' if text else ''}call {fn.get('name')}({fn.get('arguments')})"
    if m.get("role") == "tool" and m.get("tool_call_id"):
        text = f"({m['tool_call_id']}) {text}"
    return text


def reply_message(call: LLMCall, index: int = 0) -> dict[str, Any] | None:
    """The assistant message of a chat call's response choice `index` (or a completion's text as
    one), if any."""
    choices = [ch for ch in (call.response or {}).get("choices") or [] if isinstance(ch, dict)]
    if index == 0:  # choice 0 is the first, as the record's columns are (capture.assembly)
        ch = choices[0] if choices else None
    else:
        ch = next((ch for ch in choices if ch.get("index") == index), None)
    if ch is None:
        return None
    if isinstance(ch.get("message"), dict):
        return ch["message"]
    if "text" in ch:
        return {"role": "assistant", "content": ch["text"]}
    return None


def transcript(store: TraceStore | str | None, rollout_id: str, *, max_len: int | None = None,
               max_chars: int = 2000) -> Transcript:
    """The rollout's messages, tool calls, failed attempts and rewards, with trained replies marked.

    Each call shows only the messages new since the previous call (when the conversation
    grows by appending, as chat agents do); a call whose messages don't extend the previous
    ones is flagged "context rewritten". Texts longer than `max_chars` are cut.
    """
    st = open_store(store)
    r = st.get_rollout(rollout_id)
    if r is None:
        raise KeyError(f"no rollout {rollout_id!r} in {st.safe_url}")
    calls = st.calls(rollout_id)
    spans, chosen = _trained(calls, rollout_id, max_len)
    cut = (lambda s: s if len(s) <= max_chars else s[:max_chars] + f"... [{len(s) - max_chars} more chars]")
    t = Transcript(r)
    t.entries.append(TranscriptEntry("header", (
        f"rollout {r.id} task={r.task_id} mode={r.mode} status={r.status} reward={r.final_reward} "
        f"policy_version={r.policy_version} "
        f"duration={r.duration_s if r.duration_s is None else round(r.duration_s, 3)}s"
        + (f" error={r.error}" if r.error else ""))))
    if r.input is not None:
        t.entries.append(TranscriptEntry("message", cut(json.dumps(r.input, default=str)), role="input"))
    seen: dict[str | None, list[dict[str, Any]]] = {}  # per agent: the last request's messages
    replied: dict[str | None, bool] = {}
    for c in calls:
        ok = c.status_code is not None and 200 <= c.status_code < 300
        head = (f"call {c.call_index} attempt {c.attempt}" + (f" agent={c.agent_name}" if c.agent_name else "")
                + f" model={c.model} prompt={len(c.prompt_token_ids)} completion={len(c.completion_token_ids)} tokens"
                + (f" latency={c.latency_s * 1000:.1f}ms" if c.latency_s is not None else "")
                + f" training={c.is_training}" + (" partial" if c.partial else "")
                + (f" choices={len(c.choices)} trained={chosen.get(c.id, 0)}" if c.extra_choices else ""))
        if not ok:
            failed = f"{head} FAILED status={c.status_code} {c.error or ''}".rstrip()
            t.entries.append(TranscriptEntry("attempt", failed,
                                             call_index=c.call_index))
            continue
        t.entries.append(TranscriptEntry("call", head, call_index=c.call_index))
        msgs = list((c.request or {}).get("messages") or [])
        if not msgs and "prompt" in (c.request or {}):
            msgs = [{"role": "prompt", "content": str(c.request["prompt"])}]
        prev = seen.get(c.agent_name)
        if prev is not None and msgs[:len(prev)] == prev:
            new = msgs[len(prev):]
            if replied.get(c.agent_name) and new and new[0].get("role") == "assistant":
                new = new[1:]  # the previous reply, sent back: already shown
        else:
            if prev is not None:
                t.entries.append(TranscriptEntry("attempt", "context rewritten: the messages do not extend the "
                                                 "previous call's (a prefix break for training)",
                                                 call_index=c.call_index))
            new = msgs
        for m in new:
            t.entries.append(TranscriptEntry("message", cut(_message_text(m)), role=str(m.get("role")),
                                             call_index=c.call_index))
        reply = reply_message(c, chosen.get(c.id, 0))  # the reply the agent continued, as trained
        if reply is not None:
            t.entries.append(TranscriptEntry("reply", cut(_message_text(reply)), role="assistant",
                                             trained=spans.get(c.id), call_index=c.call_index))
        seen[c.agent_name], replied[c.agent_name] = msgs, reply is not None
    for rw in st.rewards(rollout_id):
        t.entries.append(TranscriptEntry("reward", f"{rw.value}" + (f" name={rw.name}" if rw.name else "")
                                         + (" (final)" if rw.final else "")))
    return t
