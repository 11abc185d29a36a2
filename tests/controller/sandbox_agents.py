"""Agents run inside the bubblewrap sandbox by tests/controller/test_sandbox.py, and in pods that
reach only the gateway (test_controller_k8s.py, test_k8s_real_cluster.py): a well-behaved coding
agent, a plain LLM caller, and an attacker that tries one thing the sandbox forbids per task
(`task["attack"]`).

Every attempt is bounded in count and time, and every network target is a loopback address.
An attempt that works returns what it got (the test then finds it in the store and fails).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from typing import Any

import httpx
import openai


def coder(task: dict[str, Any]) -> float:
    """Asks the LLM, writes a program in its work directory, runs it with Python, checks its output."""
    client = openai.OpenAI()  # OPENAI_BASE_URL and the key come from the sandbox's environment
    answer = client.chat.completions.create(model="m", messages=[{"role": "user", "content": task["prompt"]}],
                                            max_tokens=16, logprobs=True)
    text = answer.choices[0].message.content or ""
    with open("solution.py", "w") as f:
        f.write(f"print({task['a']} + {task['b']})\n")
    os.makedirs("pkg", exist_ok=True)
    with open("pkg/notes.txt", "w") as f:
        f.write(text)
    out = subprocess.run([sys.executable, "solution.py"], capture_output=True, text=True, timeout=30)
    return 1.0 if out.stdout.strip() == str(task["a"] + task["b"]) else 0.0


def caller(task: dict[str, Any]) -> float:
    """Asks the LLM once through the client's environment (a pod's: its rollout's gateway route and token)."""
    answer = openai.OpenAI().chat.completions.create(model="m", messages=[{"role": "user", "content": task["prompt"]}],
                                                     max_tokens=16, logprobs=True)
    return 1.0 if answer.choices[0].message.content else 0.0


def _own_token() -> dict[str, str]:
    """What the agent was given to reach the gateway: a pod's rollout token (in a local sandbox the
    door replaces it with the gateway's)."""
    return {"authorization": f"Bearer {os.environ.get('OPENAI_API_KEY', '')}"}


def _connect(port: int) -> str:
    with socket.create_connection(("127.0.0.1", port), timeout=3) as s:
        s.sendall(b"GET / HTTP/1.0\r\n\r\n")
        return s.recv(200).decode(errors="replace")


def attacker(task: dict[str, Any]) -> Any:
    attack = task["attack"]
    if attack == "read_store":
        with open(task["path"], "rb") as f:
            return f.read(100).hex()
    if attack == "read_secret":
        return os.environ[task["var"]]
    if attack == "connect":
        return _connect(task["port"])
    if attack == "connect_host":  # a real cluster's store or API server, which the NetworkPolicy leaves out
        with socket.create_connection((task["host"], task["port"]), timeout=5) as s:
            return s.getpeername()[0]
    if attack == "gateway_admin":  # through the door, or with the pod's rollout token
        r = httpx.post(os.environ["LIGHTNING_GATEWAY_URL"] + "/admin/pause", json={"wait": False}, timeout=10,
                       headers=_own_token())
        r.raise_for_status()
        return r.text
    if attack == "other_rollout":  # another rollout's calls, through the door
        r = httpx.get(os.environ["LIGHTNING_GATEWAY_URL"] + f"/rollouts/{task['other']}", timeout=10,
                      headers=_own_token())
        r.raise_for_status()
        return r.text
    if attack == "write_outside":
        with open(task["path"], "w") as f:
            f.write("pwned")
        return "written"
    if attack == "read_other_workdir":
        return os.listdir(task["path"])
    if attack == "fork_bomb":
        children = []
        try:
            for _ in range(400):
                pid = os.fork()
                if pid == 0:
                    time.sleep(5)
                    os._exit(0)
                children.append(pid)
        finally:
            for pid in children:
                os.kill(pid, 9)
        return f"forked {len(children)}"
    if attack == "allocate":
        block = bytearray(8 * 2**30)
        return len(block)
    if attack == "overrun":  # the deadline ends it (the test's deadline stays far below this)
        time.sleep(300)
        return "still here"
    if attack == "burn_cpu":  # the CPU-time limit ends it, however slowly a loaded machine runs it
        end = time.monotonic() + 300
        n = 0
        while time.monotonic() < end:
            n += 1
        return n
    if attack == "self_reward":
        url = os.environ["LIGHTNING_GATEWAY_URL"] + f"/rollouts/{os.environ['LIGHTNING_ROLLOUT_ID']}/reward"
        r = httpx.post(url, json={"value": 100.0}, timeout=10, headers=_own_token())
        r.raise_for_status()
        return 100.0
    raise ValueError(f"unknown attack {attack!r}")
