"""The house's rules, checked on the code itself.

- No import circle among the three packages' modules, counting every import: those inside
  functions and those under ``TYPE_CHECKING`` too.
- No module over 600 lines unless its docstring says why ("Long on purpose").
- A chat completion walks downward through the server's rooms: the route holds the model
  (``_leases``), hands the request to the plan (``_plan``: checked once, mapped, started)
  and delivers what it started (``_generation``); no room is entered twice.
"""

from __future__ import annotations

import ast
import asyncio
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

from litestar.testing import AsyncTestClient
from ortserve_server import ServerConfig, create_app
from serving import TINY_MODEL

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [ROOT / "packages" / name / "src" for name in ("runtime", "server", "client")]
MAX_LINES = 600


def _modules() -> dict[str, tuple[Path, bool]]:
    found = {}
    for source in SOURCES:
        for path in source.rglob("*.py"):
            parts = list(path.relative_to(source).with_suffix("").parts)
            package = parts[-1] == "__init__"
            found[".".join(parts[:-1] if package else parts)] = (path, package)
    return found


def _import_graph() -> dict[str, set[str]]:
    modules = _modules()

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, (path, package) in modules.items():
        here = name if package else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join([*parts, *([node.module] if node.module else [])])
                # ``from . import x`` names a module; ``from .m import f`` names module m
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for target in targets:
                resolved = known(target)
                if resolved is not None and resolved != name:
                    graph[name].add(resolved)
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_the_import_graph_is_read_whole() -> None:
    graph = _import_graph()
    # The check below means something only if edges are found, lazy ones included.
    assert "ortserve_runtime._contract" in graph["ortserve_runtime.engines._ort_cpu"]
    assert "ortserve_server.api" in graph["ortserve_server._batch_runner"]  # imported inside a function
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circle_among_the_packages_modules() -> None:
    assert _circles(_import_graph()) == []


def test_no_module_over_600_lines_without_a_reason_at_its_top() -> None:
    unexplained = []
    for path, _ in _modules().values():
        text = path.read_text(encoding="utf-8")
        lines = text.count("\n")
        docstring = ast.get_docstring(ast.parse(text)) or ""
        if lines > MAX_LINES and "Long on purpose" not in docstring:
            unexplained.append(f"{path.relative_to(ROOT)}: {lines} lines")
    assert unexplained == []


def _room(frame: FrameType | None) -> str | None:
    name = frame.f_globals.get("__name__", "") if frame is not None else ""
    return name.removeprefix("ortserve_server.") if name.startswith("ortserve_server.") else None


WALK_ROOMS = {"api.chat", "_leases", "_plan", "_messages", "_generation"}
"""The rooms of a chat request's walk (helpers such as ``_errors`` and ``_metrics`` are
called from anywhere, and the leases' middleware wraps every route)."""


def test_a_chat_request_enters_each_room_once() -> None:
    entries: list[tuple[str, str, str]] = []
    seen: set[FrameType] = set()
    tracing = False

    def profile(frame: FrameType, event: str, _: Any) -> None:
        if not tracing or event != "call" or frame in seen:
            return  # a coroutine resumed is no new call
        seen.add(frame)
        callee = _room(frame)
        if callee not in WALK_ROOMS or frame.f_code.co_name == "middleware":
            return
        caller = frame.f_back
        while caller is not None and _room(caller) is None:
            caller = caller.f_back  # through Litestar and asyncio
        if caller is not None and _room(caller) != callee:
            entries.append((str(_room(caller)), str(callee), frame.f_code.co_name))

    async def chat() -> None:
        nonlocal tracing
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        async with AsyncTestClient(create_app(ServerConfig(models={"tiny": str(TINY_MODEL)}))) as client:
            assert (await client.post("/v1/chat/completions", json=body)).status_code == 200  # loads
            tracing = True
            response = await client.post("/v1/chat/completions", json=body)
            tracing = False
            assert response.status_code == 200, response.text

    threading.setprofile(profile)  # the client's portal thread, and worker threads
    sys.setprofile(profile)
    try:
        asyncio.run(chat())
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    rooms = [callee for _, callee, _ in entries]
    assert {"_leases", "_plan", "_messages", "_generation"} <= set(rooms), entries
    assert len(rooms) == len(set(rooms)), entries  # each room entered once
    assert [caller for caller, callee, _ in entries if callee == "_plan"] == ["api.chat"], entries
