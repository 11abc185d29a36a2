"""The SmolLM2 demo's task: arithmetic word problems with a calculator tool, exact reward.

A problem is one sentence with two numbers and one operation (add, subtract, multiply) in a
story ("A shop had 412 apples and sold 178. How many apples are left?"); the numbers are large
enough that a 135M model cannot do the sum in its head, so it must call `calculator` with the
right expression and then answer with the result. Reward 1 when the last number of the final
answer equals the exact result, else 0. Train and held-out problems come from separate seeded
streams (`make_problems(n, seed, "train" | "eval")`), and `held_out_problems` drops the eval
problems whose question a train or warm-start problem asks: separate streams can still draw the
same story, name and numbers (1 of seed 0's first 128 eval problems was a train problem).

Also here: SmolLM2's own tool-call format as a chat template. SmolLM2-Instruct was trained on
function calling (Synth-APIGen) with a system prompt that lists the tools inside `<tools>` and
asks for `<tool_call>[{"name": ..., "arguments": {...}}]</tool_call>`, a JSON *list* inside
the tags, which vLLM's `xlam` tool parser reads (hermes expects one object per tag). The
converted GGUF's own template renders no tools.
"""

from __future__ import annotations

import ast
import operator
import random
import re
from collections.abc import Callable, Collection
from typing import Any

TOOL_NAME = "calculator"
TOOL_DESCRIPTION = "Evaluate an arithmetic expression such as '412 - 178' or '23 * 17'."
TOOL_PARSER = "xlam"  # vLLM's parser for `<tool_call>[...]</tool_call>` (and bare JSON lists)
SYSTEM = "Solve the math word problem. Use the calculator tool, then answer with the number."

# SmolLM2's function-calling prompt (its model card's example, as used to train it) with
# tools, then ChatML; assistant calls rendered back in the same list form; tool results as a
# `tool` turn. Without tools it is the model's own template.
SMOLLM2_TOOLS_TEMPLATE = """\
{%- set default_system = 'You are a helpful AI assistant named SmolLM, trained by Hugging Face' %}
{%- if messages[0].role == 'system' %}{%- set system = messages[0].content %}{%- set rest = messages[1:] %}
{%- else %}{%- set system = none %}{%- set rest = messages %}{%- endif %}
{{- '<|im_start|>system\\n' }}
{%- if tools %}
{%- if system %}{{- system + '\\n\\n' }}{%- endif %}
{{- 'You are an expert in composing functions. You are given a question and a set of possible functions.\\n' }}
{{- 'Based on the question, you will need to make one or more function/tool calls to achieve the purpose.\\n' }}
{{- 'If none of the functions can be used, point it out and refuse to answer.\\n' }}
{{- 'If the given question lacks the parameters required by the function, also point it out.\\n\\n' }}
{{- 'You have access to the following tools:\\n<tools>[' }}
{%- for tool in tools %}{%- if not loop.first %}{{- ', ' }}{%- endif %}
{{- (tool.function if tool.function is defined else tool) | tojson }}{%- endfor %}
{{- ']</tools>\\n\\nThe output MUST strictly adhere to the following format, and NO other text MUST be included.\\n' }}
{{- 'The example format is as follows. Please make sure the parameter type is correct. ' }}
{{- "If no function call is needed, please make the tool calls an empty list '[]'.\\n" }}
{{- '<tool_call>[\\n{"name": "func_name1", "arguments": {"argument1": "value1", "argument2": "value2"}},\\n' }}
{{- '... (more tool calls as required)\\n]</tool_call>' }}
{%- else %}{{- system if system else default_system }}{%- endif %}
{{- '<|im_end|>\\n' }}
{%- for message in rest %}
{%- if message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' }}
{%- if message.content %}{{- message.content }}{%- endif %}
{%- if message.tool_calls %}
{{- '<tool_call>[' }}
{%- for tc in message.tool_calls %}{%- set fn = tc.function if tc.function is defined else tc %}
{%- if not loop.first %}{{- ', ' }}{%- endif %}
{{- '{"name": "' + fn.name + '", "arguments": ' }}
{%- if fn.arguments is string %}{{- fn.arguments }}{%- else %}{{- fn.arguments | tojson }}{%- endif %}
{{- '}' }}{%- endfor %}
{{- ']</tool_call>' }}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

# (operation, story): {a} and {b} are the numbers, {t} a thing; the answer is op(a, b).
_STORIES: tuple[tuple[str, str], ...] = (
    ("+", "{name} has {a} {t}. {pron} gets {b} more. How many {t} does {name} have now?"),
    ("+", "A shop sold {a} {t} in the morning and {b} in the afternoon. How many {t} did it sell in all?"),
    ("-", "A shop had {a} {t} and sold {b}. How many {t} are left?"),
    ("-", "{name} had {a} {t} and gave away {b}. How many {t} does {name} have left?"),
    ("*", "A box holds {a} {t}. How many {t} are in {b} boxes?"),
    ("*", "{name} buys {b} bags with {a} {t} in each bag. How many {t} does {name} buy?"),
)
_NAMES = (("Sam", "He"), ("Mia", "She"), ("Tom", "He"), ("Ana", "She"), ("Leo", "He"), ("Zoe", "She"))
_THINGS = ("apples", "pencils", "stamps", "marbles", "books", "cards", "shells", "coins")
_OPS: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
}


def make_problems(n: int, seed: int, split: str) -> list[dict[str, Any]]:
    """n problems of one split (its own seeded stream): task_id, question, answer (an int)."""
    rng = random.Random(f"arith:{split}:{seed}")
    out = []
    for i in range(n):
        op, story = rng.choice(_STORIES)
        name, pron = rng.choice(_NAMES)
        if op == "*":
            a, b = rng.randint(12, 99), rng.randint(3, 29)
        else:
            a, b = rng.randint(120, 999), rng.randint(25, 119)
        question = story.format(name=name, pron=pron, a=a, b=b, t=rng.choice(_THINGS))
        answer = a + b if op == "+" else a - b if op == "-" else a * b
        out.append({"task_id": f"{split}-{i}", "question": question, "answer": answer, "expression": f"{a} {op} {b}"})
    return out


def held_out_problems(n: int, seed: int, seen: Collection[str]) -> tuple[list[dict[str, Any]], int]:
    """The first `n` eval problems of `seed` that ask no question in `seen` (the train and warm-start
    questions) and none twice; with how many were skipped. Problem i of a stream is the same at any
    length, so the set is as deterministic as `make_problems`."""
    asked = set(seen)
    kept: list[dict[str, Any]] = []
    limit = 2 * n + 16  # a skip is rare: 1 of seed 0's first 128
    for i, problem in enumerate(make_problems(limit, seed, "eval")):
        if len(kept) == n:
            break
        if problem["question"] not in asked:
            asked.add(problem["question"])
            kept.append(problem)
            if len(kept) == n:
                return kept, i + 1 - n
    if len(kept) < n:
        raise ValueError(f"only {len(kept)} of {limit} eval problems of seed {seed} ask a question no train or "
                         f"warm-start problem asks")
    return kept, 0


def calculate(expression: Any) -> str:
    """What the calculator tool returns: the value of a plain arithmetic expression, or an error
    message the model can read (never raises: a bad call is the model's mistake, not ours)."""
    try:
        value = _evaluate(ast.parse(str(expression).strip(), mode="eval").body)
    except (SyntaxError, ValueError, TypeError, ZeroDivisionError, OverflowError) as exc:
        return f"error: {exc.__class__.__name__}: cannot evaluate {str(expression)[:80]!r}"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if abs(left) > 1e12 or abs(right) > 1e12:  # no 10**10**10 from a sampled expression
            raise ValueError("numbers too large")
        result: int | float = _OPS[type(node.op)](left, right)
        return result
    raise ValueError("only numbers and + - * / // % are allowed")


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_number(text: str) -> float | None:
    """The last number in an answer ("... is 1,234." -> 1234.0), or None."""
    found = _NUMBER.findall(text or "")
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def reward(answer_text: str, expected: int) -> float:
    """1.0 when the final answer's last number is exactly the result, else 0.0."""
    value = final_number(answer_text)
    return 1.0 if value is not None and value == expected else 0.0
