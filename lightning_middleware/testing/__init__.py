"""Test doubles that are real servers: a deterministic OpenAI-compatible LLM (a subprocess, or
in-process as an httpx/httpx2 transport) and a throwaway PostgreSQL server; `secret_scan`, the
credential scan the test suite runs on every store it writes."""

from lightning_middleware.testing.llm_script import render_chat, tokenize
from lightning_middleware.testing.llm_server import LLMTestServer, free_port, process_cpu_seconds
from lightning_middleware.testing.llm_transport import TEST_BASE_URL, llm_http_client, llm_transport
from lightning_middleware.testing.postgres import PostgresTestServer

__all__ = [
    "LLMTestServer",
    "PostgresTestServer",
    "TEST_BASE_URL",
    "free_port",
    "llm_http_client",
    "llm_transport",
    "process_cpu_seconds",
    "render_chat",
    "tokenize",
]
