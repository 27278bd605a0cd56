"""Server configuration: which models, where to mount, and the limits that protect it."""

from __future__ import annotations

import hashlib
import re
import shlex
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from ortserve_runtime import ModelConfig, ModelRegistry

__all__ = [
    "McpServer",
    "ServerConfig",
    "check_server_config",
    "default_key_label",
    "model_registry",
    "parse_mcp_server",
    "preload",
    "url_allowed",
]


@dataclass(frozen=True, slots=True)
class McpServer:
    """An MCP server the operator configured: by ``url`` (streamable HTTP, with
    ``headers``) or by ``command`` (a process spoken to over stdio)."""

    label: str
    url: str | None = None
    command: tuple[str, ...] = ()
    headers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.label or not self.label.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"MCP server label {self.label!r}: use letters, digits, '-' and '_'")
        if (self.url is None) == (not self.command):
            raise ValueError(f"MCP server {self.label!r}: give a url or a command, not both")
        if self.url is not None:
            _check_url(self.url, f"MCP server {self.label!r}")


def parse_mcp_server(spec: str, headers: dict[str, str] | None = None) -> McpServer:
    """``LABEL=URL`` or ``LABEL=stdio:COMMAND ARGS...`` (the command split as a shell would)."""
    label, sep, target = spec.partition("=")
    if not sep or not target:
        raise ValueError(f"--mcp-server {spec!r}: expected LABEL=URL or LABEL=stdio:COMMAND ARGS")
    if target.startswith("stdio:"):
        command = tuple(shlex.split(target.removeprefix("stdio:")))
        if not command:
            raise ValueError(f"--mcp-server {spec!r}: stdio: needs a command")
        return McpServer(label, command=command, headers=headers or {})
    return McpServer(label, url=target, headers=headers or {})


def _check_url(url: str, what: str) -> urllib.parse.SplitResult:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{what}: {url!r} is not an http(s) URL")
    return parts


def url_allowed(url: str, allowed: tuple[str, ...]) -> bool:
    """Whether ``url`` is one of ``allowed`` or under one (same scheme, host and port, and a
    path below the prefix's: ``https://a.example/mcp`` allows ``.../mcp`` and ``.../mcp/x``,
    not ``https://a.example.evil`` or ``.../mcpx``). A path with a dot segment (``..``, ``.``,
    percent-encoded too, or behind a backslash) is never allowed: clients and servers remove
    them after this check (``/mcp/../secret`` is sent as ``/secret``)."""
    try:
        asked = urllib.parse.urlsplit(url)
    except ValueError:
        return False
    if asked.username or asked.password:
        return False
    segments = urllib.parse.unquote(asked.path).replace("\\", "/").split("/")
    if "." in segments or ".." in segments:
        return False
    for prefix in allowed:
        given = urllib.parse.urlsplit(prefix)
        if (asked.scheme, asked.netloc.lower()) != (given.scheme, given.netloc.lower()):
            continue
        root = given.path.rstrip("/")
        if asked.path.rstrip("/") == root or asked.path.startswith(root + "/"):
            return True
    return False


def _check_mcp_config(config: ServerConfig) -> None:
    """Refuse MCP settings that cannot work (a ``ValueError`` naming them)."""
    labels = [server.label for server in config.mcp_servers]
    twice = sorted({label for label in labels if labels.count(label) > 1})
    if twice:
        raise ValueError(f"mcp_servers: the label {twice[0]!r} is given twice")
    for prefix in config.mcp_allowed_urls:
        _check_url(prefix, "mcp_allowed_urls")
    for name in (
        "mcp_call_timeout",
        "mcp_start_timeout",
        "mcp_max_output_bytes",
        "mcp_max_message_bytes",
        "mcp_max_tool_calls",
    ):
        if getattr(config, name) <= 0:
            raise ValueError(f"{name} must be positive")
    if config.mcp_servers or config.mcp_allowed_urls:
        try:
            import mcp  # noqa: F401
        except ImportError:
            raise ValueError("MCP servers need the MCP SDK: pip install 'ortserve-server[mcp]'") from None


@dataclass(slots=True)
class ServerConfig:
    """Everything the HTTP layer needs. Defaults suit a local, single-user server."""

    models: dict[str, str | Path] = field(default_factory=dict)
    """Model name -> model folder (a genai folder, or an ONNX encoder: embedding or rerank model)."""
    path: str = "/v1"
    """Where the OpenAI-compatible routes are mounted."""
    health_path: str | None = "/health"
    """Liveness/readiness route (never behind the API key); ``None`` leaves it out."""
    metrics_path: str | None = "/metrics"
    """Prometheus text metrics; ``None`` leaves it out."""
    rerank_aliases: bool = True
    """Also answer ``POST /rerank`` and ``/v2/rerank`` at the root, as vLLM does (clients
    written for it call those); ``False`` leaves the root to a host app's own routes."""
    api_key: str | tuple[str, ...] | Mapping[str, str] | None = None
    """When set, every route but health needs ``Authorization: Bearer <api_key>``: the API,
    metrics (unless ``public_metrics``) and the OpenAPI schema. Several keys (a tuple)
    are each accepted, one per user or app: see ``prefix_cache_scope``. A mapping names
    each key (``{"team-a": key, ...}``): usage per key (``/metrics``, ``GET /v1/usage``),
    logs and traces show that label, never the key; an unnamed key is shown as
    ``key-`` and the first 8 hex digits of its SHA-256."""
    prefix_cache_scope: Literal["auto", "shared", "key"] = "auto"
    """Whose cached prompts a request may reuse. ``"shared"``: anyone's with the same
    ``cache_salt`` (or none). ``"key"``: only those sent with the same API key, so that a
    caller cannot learn from ``cached_tokens`` or timing what a caller with another key
    sent (the prefix cache's side channel); needs ``api_key``. ``"auto"``: ``"key"`` where
    ``api_key`` holds several keys (one per user or app), ``"shared"`` with one or none.
    (A fourteenth probe of the hardening issue walked another key's system prompt token by
    token from ``cached_tokens`` under the former default, ``"shared"``.)"""
    admin_key: str | None = None
    """When set, the model control routes (``POST /v1/models/load`` and ``/unload``, and the
    LoRA adapter routes where ``runtime_adapters`` allows them) need
    ``Authorization: Bearer <admin_key>`` (the API key is not enough); unset, they need
    the API key when one is set, like every other route. So does what shows every key's
    traffic: ``GET /v1/usage``, and the ``ortserve_key_*`` series of ``/metrics`` (which
    takes the admin key too; an API key gets the other series)."""
    response_id_tag: str = ""
    """Put into the ids of Responses this server makes (``resp_<tag>-<hex>``):
    ``ortserve_server.ray`` sets it to each replica's id, so that a request naming a stored
    response (``previous_response_id``, ``GET``/``DELETE /v1/responses/{id}``) is routed to
    the replica that holds it. Lower-case letters and digits (else ``ValueError``)."""
    runtime_adapters: bool = False
    """Answer ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (vLLM's
    ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``): a caller with the admin key (else the API key)
    makes the server read an adapter file from its own disk, so it is off unless asked for."""
    public_metrics: bool = False
    """Leave ``metrics_path`` open without the API key (for a scraper that has none)."""
    ui: bool = False
    """Serve the web page (chat, conversations, the server at a glance) at ``ui_path`` and
    its conversations at ``{path}/ui/conversations``. ``ortserve serve`` turns it on
    (``--no-ui``: off); a host app that mounts ortserve gets it only when it asks."""
    ui_path: str = "/"
    """Where the web page is served (its files under ``{ui_path}assets/``)."""
    tracing: Literal["auto", "off"] = "auto"
    """OpenTelemetry traces (``pip install ortserve-server[otel]``). ``"auto"``: on where
    ``otlp_endpoint`` is set, where the process has a global tracer provider of its own
    (a host app that set one before ortserve's first request: its spans and ortserve's join),
    or where ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``..._TRACES_ENDPOINT``) is set;
    ``OTEL_SDK_DISABLED=true`` turns it off. ``"off"``: never. Off, OpenTelemetry is not
    even imported."""
    otlp_endpoint: str | None = None
    """Send traces by OTLP/HTTP (protobuf) to this collector (``http://host:4318``;
    ``/v1/traces`` is appended unless the URL ends with it), with a tracer provider of
    ortserve's own (the host's global one, if any, is left alone)."""
    log_prompts: bool = False
    """Put the prompt (the request's last message) into each request's log line. Off by
    default: logs often travel further than the data they describe."""
    schema_path: str | None = "/schema"
    """Where the standalone app serves its OpenAPI schema as JSON (``openapi.json`` under it);
    ``None`` leaves it out. No HTML docs pages: they load their scripts from a CDN."""
    host_check: bool | None = None
    """Refuse requests whose ``Host`` is not a loopback name or in ``allowed_hosts`` (the
    DNS-rebinding defence). ``None``: on for connections that arrive on a loopback address,
    which is how a web page reaches a local sidecar, and off for others (a server bound to
    a public address names itself in many ways); ``True``: on for every connection;
    ``False``: off, for a host app that validates ``Host`` itself (e.g. behind a proxy)."""
    allowed_hosts: tuple[str, ...] = ()
    """Host names accepted besides ``localhost`` and loopback addresses (no port)."""
    allowed_origins: tuple[str, ...] = ()
    """Browser origins (``https://app.example:8443``) that may call the API besides loopback
    and same-origin pages; ``"*"`` allows any. Requests without ``Origin`` (SDKs, curl) pass."""
    cors_origins: tuple[str, ...] = ()
    """Origins that get CORS headers (Litestar's CORSConfig; off when empty). They are
    allowed origins too."""
    model_config: ModelConfig = field(default_factory=ModelConfig)
    """How every model runs (provider, engine, batching...), unless ``model_configs`` says otherwise."""
    model_configs: dict[str, ModelConfig] = field(default_factory=dict)
    """Per model name, a config that replaces ``model_config`` for that model (for example
    one model on ``cuda`` and an embedder on the CPU)."""
    load_on_startup: bool = True
    """Load every model when the app starts (else on first use)."""
    idle_unload: float | None = None
    """Seconds a model stays loaded after its last request (``None``: until unloaded);
    a request's ``keep_alive`` overrides it for that model."""
    max_loaded_models: int | None = None
    """Models loaded at once at most; loading one more first unloads the least recently
    used idle model, and answers 503 + Retry-After when every loaded model is busy."""
    memory_budget: int | None = None
    """Bytes the loaded models may hold (resident growth at load plus KV cache capacity);
    enforced like ``max_loaded_models``. A model's first load is estimated from its folder's size."""
    unload_grace: float = 10.0
    """Seconds an unload waits for the requests using the model before it ends them
    (streams get an error event, others a 503)."""
    max_body_size: int = 16 * 1024 * 1024
    """Largest request body in bytes; larger ones get 413."""
    max_body_memory: int = 256 * 1024 * 1024
    """Bytes of request bodies held in memory at once, across all requests; a request whose
    body would go past it gets 503 + Retry-After (see ``_body_budget``)."""
    max_queued: int = 64
    """Requests waiting for a batch row per model before new ones get 503 + Retry-After."""
    max_tokens_limit: int | None = None
    """Upper bound on ``max_tokens`` a request may ask for (``None``: the model's context)."""
    max_n: int = 8
    """Largest ``n`` (choices per request)."""
    max_guided_choices: int = 1000
    """Options ``guided_choice`` may list (OpenAI allows 1000 enum values per schema)."""
    lenient: bool = False
    """Ignore fields a request body has that this server does not know, instead of a 400
    naming them (for clients that send extras; an ignored field is a setting that does
    nothing, so it is off by default)."""
    max_grammar_bytes: int = 131_072
    """Largest output constraint (``response_format`` schema, ``guided_regex``,
    ``guided_grammar``, ``guided_choice`` as a grammar, a forced tool call's schema)."""
    image_url_hosts: tuple[str, ...] = ()
    """Hosts whose ``http(s)`` image URLs the server may fetch: ``HOST`` (any port of it) or
    ``HOST:PORT`` (``[IPV6]:PORT``; that port only). Empty: images come inline as ``data:``
    URLs only, since a server that fetches any URL it is given is an SSRF hole."""
    responses_store_max: int = 1000
    """Responses kept for ``previous_response_id`` and ``GET /v1/responses/{id}`` (those
    created with ``store: true``); the key holding the most gives its oldest first. 0
    turns storing off (``store: true`` is then a 400)."""
    responses_store_max_bytes: int = 64 * 1024 * 1024
    """Bound on the stored conversations' size (their JSON, inline images included); the
    oldest go first."""
    responses_store_ttl: float = 3600.0
    """Seconds a stored response is kept after it was made."""
    max_file_size: int = 100 * 1024 * 1024
    """Largest file ``POST /v1/files`` takes (a batch's JSONL input), in bytes."""
    files_max_bytes: int = 1024 * 1024 * 1024
    """Bytes of files and batch lines kept at once (uploads, lines and results); an upload or
    a batch past it gets 413. With several API keys, each holds at most an equal share of it."""
    files_ttl: float = 30 * 86400.0
    """Seconds a file is kept after it was made (uploads and batch results), and a batch
    after it is over."""
    batch_concurrency: int = 8
    """Lines of a batch run at once at most (behind interactive requests)."""
    state_dir: Path | None = None
    """Where state that outlives the process is kept (stored Responses, LoRA adapters loaded
    over HTTP, files and batches, in the SQLite file ``ortserve.db``; replicas may share it);
    ``None`` keeps it in this process's memory.
    ``ortserve serve`` defaults to the user's state directory (``--state-dir none``: memory)."""

    state_url: str | None = None
    """A PostgreSQL database (``postgresql://user:password@host/db``) to keep that state in
    instead of ``state_dir``: replicas given the same one share stored responses, files
    and batches (needs ``ortserve-server[postgres]``)."""

    mcp_servers: tuple[McpServer, ...] = ()
    """MCP servers whose tools the model may call through the server (the Responses API's
    ``mcp`` tools, the Messages API's ``mcp_servers``), named by their labels."""
    mcp_allowed_urls: tuple[str, ...] = ()
    """URL prefixes of MCP servers a request may name itself (``server_url``, ``url``);
    empty: only configured labels. The server connects to them from its own network."""
    mcp_call_timeout: float = 60.0
    """Seconds an MCP tool call may take; after it, the model reads a timeout error."""
    mcp_start_timeout: float = 30.0
    """Seconds to connect to an MCP server and list its tools (then the request gets 424)."""
    mcp_list_ttl: float = 300.0
    """Seconds a configured server's tool list is kept before it is listed again."""
    mcp_max_output_bytes: int = 64 * 1024
    """A tool result longer than this reaches the model cut, with a note saying so."""
    mcp_max_message_bytes: int = 8 * 1024 * 1024
    """The longest message an MCP server may send (a result, a tool list): the call fails; a
    stdio server's process is stopped for it (it starts again on next use)."""
    mcp_max_tool_calls: int = 16
    """MCP calls one response may make when it does not set ``max_tool_calls`` (at most
    this when it does); then the model must answer without tools."""

    @property
    def api_keys(self) -> tuple[str, ...]:
        """The accepted API keys (none: the API is open)."""
        return tuple(self.api_key_labels)

    @property
    def keys_cached_apart(self) -> bool:
        """Whether each API key's callers reuse only their own cached prompts (see
        ``prefix_cache_scope``)."""
        if self.prefix_cache_scope == "auto":
            return len(self.api_key_labels) > 1
        return self.prefix_cache_scope == "key"

    @property
    def api_key_labels(self) -> dict[str, str]:
        """Each accepted API key and the label it is shown by (see ``api_key``)."""
        if isinstance(self.api_key, Mapping):
            return {key: label for label, key in self.api_key.items() if key}
        keys = (self.api_key,) if isinstance(self.api_key, str) else self.api_key or ()
        return {key: default_key_label(key) for key in keys if key}


def default_key_label(key: str) -> str:
    """The label of a key the operator did not name: stable across restarts (usage is kept
    by label), and no help in guessing the key."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:8]


_KEY_LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def check_server_config(config: ServerConfig) -> None:
    """Refuse settings that contradict each other or cannot work: a ``ValueError`` naming them."""
    unknown = sorted(set(config.model_configs) - set(config.models))
    if unknown:
        raise ValueError(f"model_configs names models that are not served: {', '.join(unknown)}")
    if re.fullmatch(r"[a-z0-9]*", config.response_id_tag) is None:  # the tag ray.response_owner reads
        raise ValueError(f"response_id_tag must be lower-case letters and digits, got {config.response_id_tag!r}")
    if config.prefix_cache_scope not in ("auto", "shared", "key"):
        raise ValueError(f"prefix_cache_scope must be 'auto', 'shared' or 'key', got {config.prefix_cache_scope!r}")
    if isinstance(config.api_key, Mapping):
        bad = [label for label in config.api_key if not _KEY_LABEL.fullmatch(label)]
        if bad:
            raise ValueError(f"api_key label {bad[0]!r}: use letters, digits, '.', '-' and '_' (at most 64)")
    if config.tracing not in ("auto", "off"):
        raise ValueError(f"tracing must be 'auto' or 'off', got {config.tracing!r}")
    if config.prefix_cache_scope == "key" and not config.api_keys:
        raise ValueError("prefix_cache_scope 'key' keeps API keys' callers apart: set api_key (one or several)")
    if config.state_url is not None and config.state_dir is not None:
        raise ValueError("state_dir and state_url name two places for the same state: give one")
    if not config.ui_path.startswith("/"):
        raise ValueError(f"ui_path must start with '/', got {config.ui_path!r}")
    if config.batch_concurrency < 1 or config.max_file_size < 1:
        raise ValueError("batch_concurrency and max_file_size must be at least 1")
    _check_mcp_config(config)


def model_registry(config: ServerConfig) -> ModelRegistry:
    """The registry of ``config``'s models, nothing loaded yet (``config`` checked first)."""
    check_server_config(config)
    registry = ModelRegistry(
        config.model_config,
        idle_unload=config.idle_unload,
        max_loaded=config.max_loaded_models,
        memory_budget=config.memory_budget,
        unload_grace=config.unload_grace,
    )
    for name, path in config.models.items():
        registry.add(name, path, config.model_configs.get(name))
    if config.model_config.quantize is not None:
        # A model's own config says quantize only of a checkpoint (the registry checks);
        # the default's is read by the checkpoints among the models that take it.
        from ortserve_runtime.sources import source_kind

        takers = [name for name in config.models if name not in config.model_configs]
        if not any(source_kind(registry.status_of(name).path) == "checkpoint" for name in takers):
            raise ValueError(
                "quantize (--quantize) applies to transformers checkpoints (a folder of config.json and "
                "safetensors); no model served with the default config is one"
            )
    return registry


def preload(config: ServerConfig, registry: ModelRegistry) -> None:
    """Start loading what startup will load, before any event loop runs (see
    :meth:`ModelRegistry.preload`). Not with a memory budget: loads there make room one by
    one, measured."""
    if config.load_on_startup and config.memory_budget is None:
        registry.preload(registry.names()[: config.max_loaded_models])
