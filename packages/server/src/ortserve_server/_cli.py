"""The ``ortserve`` command: ``serve``, ``pull``, ``ls`` (local models) and ``ps`` (a running server's models).

Long on purpose (over 600 lines): most of it is the parser, every flag with its help text
(the CLI reference is generated from it), and turning flags into the server's config.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import json
import logging
import os
import re
import signal
import socket
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ._demo import demo_models

if TYPE_CHECKING:
    from ortserve_runtime import ModelConfig

    from ._config import McpServer
    from ._state import OrtServe

__all__ = ["main"]

PARENT_PID_ENV = "ORTSERVE_PARENT_PID"
EXIT_WORK_CUT = 75
"""Exit status when a shutdown had to cut in-flight requests (sysexits' EX_TEMPFAIL: the
work may be retried); 0 when everything finished within the grace period."""
CUT_BACKSTOP = 2.0
"""Seconds after the grace period that requests still running are cancelled outright."""
logger = logging.getLogger("ortserve.server")


def _parse_model(value: str) -> tuple[str, Path]:
    """``NAME=PATH``, or ``PATH`` alone, named after its last part (a GGUF file's without
    ``.gguf`` and a split file's part number)."""
    name, sep, path = value.partition("=")
    if not sep:
        path = name
        name = re.sub(r"(-\d{5}-of-\d{5})?\.gguf$", "", Path(path).name, flags=re.IGNORECASE) or Path(path).name
    if not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {value!r}")
    return name, Path(path)


def _parse_option(value: str) -> tuple[str, str]:
    key, sep, option = value.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {value!r}")
    return key, option


def _parse_model_option(value: str) -> tuple[str, str, str]:
    name, sep, rest = value.partition(":")
    key, eq, option = rest.partition("=")
    if not sep or not eq or not name or not key:
        raise argparse.ArgumentTypeError(f"expected NAME:KEY=VALUE, got {value!r}")
    return name, key, option


def _parse_adapter(value: str) -> tuple[str, str, Path]:
    """``MODEL:NAME=PATH`` (the model's name may itself hold ``:``; the adapter's may not)."""
    model_and_name, eq, path = value.partition("=")
    model, sep, name = model_and_name.rpartition(":")
    if not eq or not sep or not model or not name or not path:
        raise argparse.ArgumentTypeError(f"expected MODEL:NAME=PATH, got {value!r}")
    return model, name, Path(path)


def _with_adapters(
    base: ModelConfig, configs: dict[str, ModelConfig], adapters: Sequence[tuple[str, str, Path]], names: Sequence[str]
) -> dict[str, ModelConfig]:
    """``configs`` (per model, else ``base``) with ``--adapter MODEL:NAME=PATH`` added to
    those models' ``adapters``. Unknown models or an adapter named twice are a ``ValueError``."""
    by_model: dict[str, dict[str, Path]] = {}
    for model, name, path in adapters:
        if model not in names:
            raise ValueError(f"--adapter {model}:{name}: no model named {model!r} is served")
        if name in by_model.setdefault(model, {}):
            raise ValueError(f"--adapter {model}:{name}: adapter {name!r} of model {model!r} is given twice")
        by_model[model][name] = path
    changed = {model: dataclasses.replace(configs.get(model, base), adapters=a) for model, a in by_model.items()}
    return {**configs, **changed}


# The runtime's PROVIDERS and engine names, spelled out so that `ortserve pull` and `ls`
# start without importing onnxruntime (a test keeps them equal).
PROVIDERS = ("cpu", "cuda", "dml", "qnn", "openvino", "webgpu", "trt-rtx")
ENGINES = ("auto", "ort-cpu", "og-engine", "og-generator")
_MEDIA_KEYS = (
    "multimodal-concurrency",
    "max-images",
    "max-image-pixels",
    "max-request-image-pixels",
    "max-request-audio-samples",
)
"""Settings only a multimodal model (images, and audio for some, in chats) reads."""
_MODEL_KEYS = (
    "provider",
    "engine",
    "device-id",
    "threads",
    "max-batch-size",
    "max-sequence-length",
    "prefix-cache-tokens",
    "prefix-cache-mb",
    "kv-cache-dtype",
    "prefill-int8",
    "reproducible",
    "quantize",
    "chat-template",
    "tools-in-system-prompt",
    "speculative",
    *_MEDIA_KEYS,
    "max-audio-seconds",
)


_INTEGER_KEYS = (
    "threads",
    "max-batch-size",
    "max-sequence-length",
    "prefix-cache-tokens",
    *_MEDIA_KEYS,
)


def _model_configs(
    base: ModelConfig, options: Sequence[tuple[str, str, str]], names: Sequence[str]
) -> dict[str, ModelConfig]:
    """Per-model configs from ``--model-option NAME:KEY=VALUE``: ``base`` with those keys
    replaced (``provider-option.K=V`` adds a provider option). Unknown names or keys are a
    ``ValueError`` naming them."""
    changes: dict[str, dict[str, object]] = {}
    for name, key, value in options:
        if name not in names:
            raise ValueError(f"--model-option {name}:{key}: no model named {name!r} is served")
        change = changes.setdefault(name, {})
        provider_options = change.setdefault("provider_options", dict(base.provider_options))
        assert isinstance(provider_options, dict)
        if key.startswith("provider-option."):
            provider_options[key.removeprefix("provider-option.")] = value
        elif key == "device-id":
            provider_options["device_id"] = str(_integer(key, value))
        elif key in ("provider", "engine", "quantize"):
            change[key] = value  # ModelConfig names the choices
        elif key == "kv-cache-dtype":
            change["kv_cache_dtype"] = value  # ModelConfig names the choices
        elif key == "prefill-int8":
            change["prefill_int8"] = _prefill_int8(value)
        elif key == "chat-template":
            change["chat_template"] = Path(value)
        elif key == "prefix-cache-mb":
            change["prefix_cache_mb"] = _mebibytes(key, value)
        elif key == "speculative":
            change["speculative"] = _speculative(value)
        elif key in ("tools-in-system-prompt", "reproducible"):
            if value not in ("on", "off"):
                raise ValueError(f"--model-option {name}:{key}: use on or off, not {value!r}")
            change[key.replace("-", "_")] = value == "on"
        elif key in _INTEGER_KEYS:
            field = {"threads": "intra_op_threads"}.get(key, key.replace("-", "_"))
            change[field] = _integer(key, value)
        elif key == "max-audio-seconds":
            change["max_audio_seconds"] = _seconds(key, value)
        else:
            raise ValueError(
                f"--model-option {name}:{key}: unknown key; use one of {', '.join(_MODEL_KEYS)} or provider-option.KEY"
            )
    return {name: dataclasses.replace(base, **change) for name, change in changes.items()}  # type: ignore[arg-type]


_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)(b?)\s*", re.IGNORECASE)


def parse_size(value: str) -> int:
    """Bytes from ``123``, ``512M``, ``8G``, ``1.5GiB`` (binary) or ``8GB`` (decimal)."""
    match = _SIZE.fullmatch(value)
    if match is None:
        raise argparse.ArgumentTypeError(f"expected a size such as 8G, 512MiB or 2000000000, got {value!r}")
    number, prefix, binary, byte = match.groups()
    power = "kmgt".find(prefix.lower()) + 1
    base = 1000 if prefix and byte and not binary else 1024
    size = int(float(number) * base**power)
    if size <= 0:
        raise argparse.ArgumentTypeError(f"the size must be positive, got {value!r}")
    return size


def _positive(kind: type[int | float]) -> Callable[[str], int | float]:
    def parse(value: str) -> int | float:
        try:
            number = kind(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {value!r}") from None
        if not number > 0:  # NaN too
            raise argparse.ArgumentTypeError(f"expected a positive number, got {value!r}")
        return number

    return parse


def _speculative(value: str) -> str | None:
    if value in ("ngram", "off"):
        return None if value == "off" else value
    if value.startswith("draft:") and value.removeprefix("draft:").strip():
        return "draft:" + str(Path(value.removeprefix("draft:")).expanduser().resolve())
    raise ValueError(f"speculative must be ngram, draft:FOLDER or off, got {value!r}")


def _prefill_int8(value: str) -> bool | None:
    choices = {"auto": None, "on": True, "off": False}
    if value not in choices:
        raise ValueError(f"prefill-int8 must be one of auto, on, off, got {value!r}")
    return choices[value]


def _mebibytes(key: str, value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{key} must be a size in MiB, got {value!r}") from None


def _seconds(key: str, value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{key} must be a number of seconds, got {value!r}") from None


def _integer(key: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{key} must be an integer, got {value!r}") from None


def _resolve_model(name: str, source: Path) -> Path:
    """A local path as given, or an ``hf:`` reference (a folder of a repo or one GGUF
    file, see ``HubReference``) downloaded through the client: the path to serve."""
    from ortserve_client import HubReference  # light: no httpx until a download

    reference = HubReference.parse(source)
    if reference is None:
        return source
    from ortserve_client import DownloadError, pull

    print(f"downloading {reference} for model {name!r}", file=sys.stderr)
    try:
        folder = pull(reference.repo_id, subfolder=reference.subfolder, allow_patterns=reference.allow_patterns)
        return reference.local_path(folder)
    except DownloadError as exc:  # reported like any other bad --model: a line, exit status 2
        raise ValueError(f"model {name!r}: {exc}") from exc


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ortserve", description="Serve ONNX Runtime GenAI models (OpenAI API).")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the HTTP server")
    serve.add_argument(
        "--model",
        action="append",
        type=_parse_model,
        default=[],
        metavar="NAME=PATH",
        help="a model folder, a GGUF file (FILE.gguf; a split one by its first part, NAME-00001-of-0000N.gguf) "
        "or a transformers checkpoint folder (config.json and safetensors: built by og's builder, see --quantize), "
        "or one on Hugging Face: hf:OWNER/REPO[/SUBFOLDER] (a folder) or hf:OWNER/REPO[/SUBFOLDER]/FILE.gguf "
        "(only that file, every part of a split one); repeatable",
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    serve.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="[LABEL=]KEY",
        help="a key callers must send (Authorization: Bearer KEY); repeatable, one per user or app; "
        "LABEL names it in usage per key, logs and traces (else key-<8 hex digits of its SHA-256>; "
        "a key that holds '=' must be given with a label); or ORTSERVE_API_KEY",
    )
    serve.add_argument(
        "--state-dir",
        default=None,
        metavar="DIR|none",
        help="where state that outlives the server is kept (stored Responses, LoRA adapters loaded over HTTP, "
        "files and batches, in DIR/ortserve.db); "
        "'none' keeps it in memory (default: the user's state directory, or ORTSERVE_STATE_DIR)",
    )
    serve.add_argument(
        "--state-url",
        default=None,
        metavar="postgresql://...",
        help="keep that state in PostgreSQL instead, shared by the replicas given the same URL "
        "(needs ortserve-server[postgres]); or ORTSERVE_STATE_URL",
    )
    serve.add_argument(
        "--batch-concurrency",
        type=int,
        default=8,
        metavar="N",
        help="lines of a batch (/v1/batches) run at once at most, behind interactive requests (default 8)",
    )
    serve.add_argument(
        "--max-file-mb",
        type=float,
        default=100,
        metavar="MB",
        help="largest file /v1/files takes (a batch's JSONL input; default 100)",
    )
    serve.add_argument(
        "--prefix-cache-scope",
        choices=("auto", "shared", "key"),
        default="auto",
        help="whose cached prompts a request may reuse: anyone's (shared) or only its own API key's (key), "
        "so a caller cannot learn from cached_tokens or timing what another key's callers sent "
        "(default: auto, key with several --api-key, else shared)",
    )
    serve.add_argument(
        "--provider",
        choices=PROVIDERS,
        default="cpu",
        help="execution provider for every model (per model: --model-option NAME:provider=...)",
    )
    serve.add_argument(
        "--provider-option",
        action="append",
        type=_parse_option,
        default=[],
        metavar="KEY=VALUE",
        help="an execution provider option (e.g. device_id=1, or OpenVINO's load_config); repeatable",
    )
    serve.add_argument("--device-id", type=int, default=None, help="the accelerator to use (provider option device_id)")
    serve.add_argument(
        "--engine",
        choices=ENGINES,
        default="auto",
        help="what runs generation: ort-cpu (CPU continuous batching), og-engine (og.Engine), og-generator "
        "(an og.Generator per request); auto picks from provider and model",
    )
    serve.add_argument(
        "--model-option",
        action="append",
        type=_parse_model_option,
        default=[],
        metavar="NAME:KEY=VALUE",
        help=f"a setting for one model: {', '.join(_MODEL_KEYS)}, or provider-option.KEY; repeatable",
    )
    serve.add_argument(
        "--adapter",
        action="append",
        type=_parse_adapter,
        default=[],
        metavar="MODEL:NAME=PATH",
        help="a LoRA adapter (.onnx_adapter) of a model, requested as model MODEL:NAME; repeatable",
    )
    serve.add_argument(
        "--allow-runtime-adapters",
        action="store_true",
        help="answer POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's routes; they read an "
        "adapter file named by the caller, who needs the admin key where one is set)",
    )
    serve.add_argument("--max-batch-size", type=int, default=32, help="requests decoded together (default 32)")
    serve.add_argument("--max-sequence-length", type=int, default=4096)
    serve.add_argument("--max-queued", type=int, default=64)
    serve.add_argument(
        "--prefix-cache-tokens",
        type=int,
        default=16384,
        help="tokens of earlier prompts the ort-cpu engine keeps to skip their prefill again (0: off)",
    )
    serve.add_argument(
        "--prefix-cache-mb",
        type=float,
        default=None,
        metavar="MIB",
        help="the prefix cache's budget in MiB of key/values instead of --prefix-cache-tokens (a token's size "
        "depends on the model; 0: off)",
    )
    serve.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "fp16", "int8"],
        default="auto",
        help="ort-cpu: how the key/value cache stores keys and values: auto (the model's own type, exact), "
        "fp16 (half an fp32 model's bytes) or int8 (a quarter; per-channel scales measured once per model); "
        "both move logprobs a little (see docs/performance.md)",
    )
    serve.add_argument(
        "--prefill-int8",
        choices=["auto", "on", "off"],
        default="off",
        help="ort-cpu: prefill int4 models through an int8 copy of their matrices, converted at the first load "
        "into $ORTSERVE_CACHE/int8-prefill (about 1.5x faster prefill on CPUs with VNNI; costs memory, and "
        "greedy replies change as rounding changes them, and with what shares a call: the model is no longer "
        "reproducible); auto: on where the CPU has VNNI (default off)",
    )
    serve.add_argument(
        "--reproducible",
        action="store_true",
        help="ort-cpu: the same tokens for the same request whatever the prefix cache holds and whoever runs "
        "beside it, at a cost (replies are prefilled again for the cache rather than reused as decoded; a lone "
        "stream of a 4-bit model decodes beside a dummy row on AVX2 CPUs: 13-32%% slower, measured); "
        "per model: --model-option NAME:reproducible=on",
    )
    serve.add_argument(
        "--quantize",
        choices=["int4", "int8", "fp16", "fp32"],
        default=None,
        help="the precision a transformers checkpoint (a folder of config.json and safetensors) is built in by "
        "og's builder at its first load (default int4: k_quant, the most sensitive matrices in int8; fp16 on GPU "
        "providers); needs the checkpoints extra (torch, transformers); per model: "
        "--model-option NAME:quantize=int8",
    )
    serve.add_argument(
        "--lenient",
        action="store_true",
        help="ignore request fields this server does not know instead of a 400 naming them (for clients that send "
        "extras; an ignored field is a setting that does nothing)",
    )
    serve.add_argument(
        "--speculative",
        default="off",
        metavar="ngram|draft:FOLDER|off",
        help="speculative decoding for every generative model (one model: --model-option NAME:speculative=ngram): "
        "ngram drafts a request's next tokens from its prompt and output (quoting, editing, RAG answers), checked "
        "in one model call; on ort-cpu while a request runs alone, on og-generator by onnxruntime-genai. "
        "draft:FOLDER (ort-cpu): a smaller genai model with the same tokenizer drafts. Requests with a prediction "
        "speculate on ort-cpu without it (default off)",
    )
    serve.add_argument(
        "--chat-template",
        type=Path,
        default=None,
        metavar="FILE",
        help="a Jinja chat template used for every generative model instead of its own (one model: "
        "--model-option NAME:chat-template=FILE); a template that does not parse fails that model's load",
    )
    serve.add_argument("--threads", type=int, default=None, help="onnxruntime intra-op threads")
    serve.add_argument(
        "--mcp-server",
        action="append",
        default=[],
        metavar="LABEL=URL|LABEL=stdio:COMMAND",
        help="an MCP server whose tools requests may use by LABEL (Responses 'mcp' tools, Messages "
        "'mcp_servers'): a streamable-HTTP URL, or stdio: and a command to start; repeatable",
    )
    serve.add_argument(
        "--mcp-header",
        action="append",
        default=[],
        metavar="LABEL=NAME:ENV_VAR",
        help="send header NAME to MCP server LABEL, its value read from environment variable ENV_VAR "
        "(secrets stay off the command line); repeatable",
    )
    serve.add_argument(
        "--allow-mcp-url",
        action="append",
        default=[],
        metavar="URL",
        help="let requests name MCP servers by URL under this prefix (default: configured labels only); repeatable",
    )
    serve.add_argument(
        "--mcp-call-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="longest MCP tool call; the model reads a timeout error after it (default: 60)",
    )
    serve.add_argument(
        "--allow-image-host",
        action="append",
        default=[],
        metavar="HOST[:PORT]",
        help="fetch http(s) image URLs from this host, any port or only PORT (default: data: URLs only); repeatable",
    )
    serve.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="HOST",
        help="answer this Host name too (loopback connections answer only loopback names); repeatable",
    )
    serve.add_argument(
        "--allow-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="let browser pages of this origin (https://app.example) call the API; repeatable",
    )
    serve.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="send CORS headers to this origin (and allow it); repeatable; default: no CORS",
    )
    serve.add_argument("--public-metrics", action="store_true", help="serve /metrics without the API key")
    serve.add_argument(
        "--ui",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="serve the web page (chat, conversations kept per API key, the server at a glance) at /",
    )
    serve.add_argument(
        "--admin-key",
        default=os.environ.get("ORTSERVE_ADMIN_KEY"),
        help="key the model load/unload routes need instead of the API key (or ORTSERVE_ADMIN_KEY)",
    )
    models = serve.add_argument_group("model residency")
    models.add_argument("--lazy", action="store_true", help="load each model on its first request, not at startup")
    models.add_argument(
        "--idle-unload",
        type=_positive(float),
        default=None,
        metavar="SECONDS",
        help="unload a model this long after its last request (default: keep loaded); keep_alive overrides",
    )
    models.add_argument(
        "--max-loaded-models",
        type=_positive(int),
        default=None,
        metavar="N",
        help="models loaded at once at most: loading another unloads the least recently used idle one, "
        "or answers 503 + Retry-After when all are busy",
    )
    models.add_argument(
        "--memory-budget",
        type=parse_size,
        default=None,
        metavar="SIZE",
        help="memory the loaded models may hold (8G, 512MiB; resident growth at load plus KV cache), "
        "enforced like --max-loaded-models",
    )
    models.add_argument(
        "--unload-grace",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="how long an unload waits for a model's requests before it ends them (default 10)",
    )
    serve.add_argument(
        "--grace-period",
        type=float,
        default=10.0,
        help="seconds in-flight work gets on SIGTERM; then streams end with an error event and the exit status is 75",
    )
    connections = serve.add_argument_group("connections")
    connections.add_argument(
        "--header-timeout",
        type=_positive(float),
        default=10.0,
        help="seconds a request's headers may take to arrive, from connect or the previous response (default 10)",
    )
    connections.add_argument(
        "--body-timeout",
        type=_positive(float),
        default=10.0,
        help="seconds in which a request body must bring --body-min-rate bytes a second, else 408 (default 10)",
    )
    connections.add_argument(
        "--body-min-rate",
        type=int,
        default=1024,
        help="bytes a second a request body must average over each --body-timeout window (default 1024)",
    )
    connections.add_argument(
        "--send-timeout",
        type=_positive(float),
        default=60.0,
        help="seconds an answer may wait for its client to read any of it; then the connection closes (default 60)",
    )
    connections.add_argument(
        "--max-body-memory-mb",
        type=float,
        default=256.0,
        help="MiB of request bodies held in memory at once across all requests; past it, 503 (default 256)",
    )
    connections.add_argument(
        "--keep-alive-timeout", type=float, default=5.0, help="close a keep-alive connection idle this long (default 5)"
    )
    connections.add_argument(
        "--max-connections",
        type=int,
        default=None,
        help="open connections at most; past it the one waiting longest for its request is closed "
        "(default 1000, less under a low open-file limit)",
    )
    connections.add_argument(
        "--max-header-size", type=int, default=16384, help="bytes of request line and headers at most (default 16384)"
    )
    serve.add_argument(
        "--ready-json",
        action="store_true",
        help='print {"event": "ready", "port": ..., "pid": ...} on stdout once accepting connections',
    )
    observe = serve.add_argument_group("logs and traces (see docs/guides/observability.md)")
    observe.add_argument(
        "--log-level",
        default=None,
        help="debug, info (a line per request), warning... (default: warning; info with --log-format json)",
    )
    observe.add_argument(
        "--log-format",
        choices=("plain", "json"),
        default="plain",
        help="json: one JSON object a line (time, level, request_id, route, model, status, tokens, durations)",
    )
    observe.add_argument(
        "--log-prompts", action="store_true", help="put each request's prompt into its log line (off: never logged)"
    )
    observe.add_argument(
        "--otlp-endpoint",
        default=None,
        metavar="URL",
        help="send OpenTelemetry traces by OTLP/HTTP to this collector (http://host:4318); the OTEL_* "
        "variables (OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_SERVICE_NAME...) work too; needs ortserve-server[otel]",
    )
    observe.add_argument(
        "--no-tracing", action="store_true", help="no traces even where the OTEL_* variables ask for them"
    )

    pull_cmd = commands.add_parser("pull", help="download a model from Hugging Face")
    pull_cmd.add_argument("repo", help="OWNER/REPO[/SUBFOLDER] or OWNER/REPO[/SUBFOLDER]/FILE.gguf (that file only)")
    pull_cmd.add_argument("--revision", default=None)

    commands.add_parser(
        "ls", help="list local models (demo models, and model folders and GGUF files in the Hugging Face cache)"
    )

    ps = commands.add_parser("ps", help="list a running server's models: state, memory, requests in flight")
    ps.add_argument("--url", default="http://127.0.0.1:8000/v1", help="the server's API base URL")
    ps.add_argument("--api-key", default=os.environ.get("ORTSERVE_API_KEY"), help="or ORTSERVE_API_KEY")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "pull":
        return _pull(args)
    if args.command == "ps":
        return _ps(args)
    return _ls()


_CHAT_KEYS = ("chat-template", "tools-in-system-prompt", "speculative", "prefix-cache-mb", "kv-cache-dtype")


def _check_chat_options(options: Sequence[tuple[str, str, str]], folders: dict[str, Path]) -> None:
    """A setting given for one model that does not read it (a chat setting for an
    embedding, rerank or speech model; an image or audio bound for a model without them;
    an audio length for a model that does not transcribe) is a ``ValueError`` naming it,
    not a setting nothing reads."""
    from ortserve_runtime import ModelLoadError, detect_model_kind, media_inputs

    for name, key, _ in options:
        if key not in (*_CHAT_KEYS, *_MEDIA_KEYS, "max-audio-seconds") or name not in folders:
            continue
        try:
            kind = detect_model_kind(folders[name])
        except ModelLoadError:
            continue  # the model fails its own load, with the reason
        if key in _CHAT_KEYS and kind != "generative":
            raise ValueError(f"--model-option {name}:{key}: model {name!r} is a {kind} model; it has no chat")
        wanted = {"max-request-audio-samples": {"audio"}, "multimodal-concurrency": {"image", "audio"}}.get(
            key, {"image"}
        )
        if key in _MEDIA_KEYS and not media_inputs(folders[name]) & wanted:
            named = " or ".join(sorted("images" if what == "image" else what for what in wanted))
            also = "; a speech model's bound is max-audio-seconds" if kind == "speech" and "audio" in wanted else ""
            raise ValueError(f"--model-option {name}:{key}: model {name!r} takes no {named} in its chats{also}")
        if key == "max-audio-seconds" and kind != "speech":
            raise ValueError(f"--model-option {name}:{key}: model {name!r} is a {kind} model; it transcribes nothing")


def _mcp_servers(specs: list[str], header_specs: list[str]) -> tuple[McpServer, ...]:
    """``--mcp-server`` and ``--mcp-header`` values as servers (``ValueError`` naming a bad one)."""
    from ._config import McpServer, parse_mcp_server

    headers: dict[str, dict[str, str]] = {}
    for spec in header_specs:
        label, _, rest = spec.partition("=")
        name, _, variable = rest.partition(":")
        if not label or not name or not variable:
            raise ValueError(f"--mcp-header {spec!r}: expected LABEL=NAME:ENV_VAR")
        if variable not in os.environ:
            raise ValueError(f"--mcp-header {spec!r}: environment variable {variable} is not set")
        headers.setdefault(label, {})[name] = os.environ[variable]
    servers = tuple(parse_mcp_server(spec) for spec in specs)
    unknown = sorted(set(headers) - {server.label for server in servers})
    if unknown:
        raise ValueError(f"--mcp-header names {unknown[0]!r}, which no --mcp-server has")
    for server in servers:
        if server.label in headers and server.url is None:
            raise ValueError(f"--mcp-header {server.label!r}: a stdio server takes no headers")
    return tuple(McpServer(s.label, url=s.url, command=s.command, headers=headers.get(s.label, {})) for s in servers)


def _api_keys(given: list[str]) -> dict[str, str]:
    """``--api-key`` values as labels and keys: ``LABEL=KEY`` (a label of letters, digits,
    '.', '-', '_'), or a bare key, labelled as ``ServerConfig.api_key`` labels unnamed ones."""
    from ._config import default_key_label

    labelled: dict[str, str] = {}
    for value in given:
        label, sep, key = value.partition("=")
        if not (sep and key and re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", label)):
            label, key = default_key_label(value), value
        if label in labelled and labelled[label] != key:
            raise ValueError(f"--api-key: the label {label!r} names two keys")
        labelled[label] = key
    return labelled


def _configure_logging(level: str, log_format: str) -> None:
    """Plain lines (``LEVEL logger: message``), or one JSON object a line."""
    handler = logging.StreamHandler()
    if log_format == "json":
        from ._observe import JsonLogFormatter

        handler.setFormatter(JsonLogFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)  # over any an import set
    logging.getLogger("asyncio").addFilter(_lost_connection_writes)


def _lost_connection_writes(record: logging.LogRecord) -> bool:
    """Drops asyncio's "socket.send() raised exception." (seventeenth probe: 381 lines in a
    5-minute run where clients cut their streams). A stream whose client has gone writes its
    events already made before uvicorn hears of the loss, within one turn of the event loop;
    the transport drops them, and asyncio logs each past the fifth. Nothing is lost but the
    line."""
    return record.getMessage() != "socket.send() raised exception."


def _state_dir(given: str | None) -> Path | None:
    """``--state-dir``: a folder, ``none`` (memory), or by default ``ORTSERVE_STATE_DIR``,
    else the user's state directory."""
    given = given if given is not None else os.environ.get("ORTSERVE_STATE_DIR")
    if given is not None:
        return None if given.lower() == "none" else Path(given).expanduser()
    import platformdirs

    return Path(platformdirs.user_state_dir("ortserve", appauthor=False))


def _serve(args: argparse.Namespace) -> int:
    # What start-up makes (the imports, the app, the models) lives as long as the process:
    # the collector's 200 passes over it took 65 ms of the GIL the start-up is bound by. It
    # runs again once the models are in (_run); meanwhile measured_load skips its collection
    # (none can run during the load).
    gc.disable()
    from ortserve_runtime import ModelConfig, ModelLoadError

    from ._config import ServerConfig, model_registry, preload

    args.log_level = args.log_level or ("info" if args.log_format == "json" else "warning")
    _configure_logging(args.log_level, args.log_format)
    models = dict(args.model) if args.model else demo_models()
    if not models:
        print("ortserve: no models: pass --model NAME=PATH", file=sys.stderr)
        return 2
    try:
        resolved = {name: _resolve_model(name, path) for name, path in models.items()}
        _check_chat_options(args.model_option, resolved)
        provider_options = dict(args.provider_option)
        if args.device_id is not None:
            provider_options["device_id"] = str(args.device_id)
        model_config = ModelConfig(
            provider=args.provider,
            provider_options=provider_options,
            engine=args.engine,
            max_batch_size=args.max_batch_size,
            max_sequence_length=args.max_sequence_length,
            intra_op_threads=args.threads,
            prefix_cache_tokens=args.prefix_cache_tokens,
            prefix_cache_mb=args.prefix_cache_mb,
            kv_cache_dtype=args.kv_cache_dtype,
            prefill_int8=_prefill_int8(args.prefill_int8),
            reproducible=args.reproducible,
            quantize=args.quantize,
            chat_template=args.chat_template,
            speculative=_speculative(args.speculative),
        )
        state_url = args.state_url or os.environ.get("ORTSERVE_STATE_URL") or None
        config = ServerConfig(
            models=dict(resolved),
            model_config=model_config,
            model_configs=_with_adapters(
                model_config,
                _model_configs(model_config, args.model_option, list(models)),
                args.adapter,
                list(models),
            ),
            api_key=_api_keys(args.api_key) or os.environ.get("ORTSERVE_API_KEY") or None,
            prefix_cache_scope=args.prefix_cache_scope,
            # With a state URL the default state dir is not used; one given as well is refused.
            state_dir=_state_dir(args.state_dir) if args.state_dir or not state_url else None,
            state_url=state_url,
            batch_concurrency=args.batch_concurrency,
            max_file_size=int(args.max_file_mb * 1024 * 1024),
            max_queued=args.max_queued,
            image_url_hosts=tuple(args.allow_image_host),
            mcp_servers=_mcp_servers(args.mcp_server, args.mcp_header),
            mcp_allowed_urls=tuple(args.allow_mcp_url),
            mcp_call_timeout=args.mcp_call_timeout,
            allowed_hosts=tuple(args.allow_host),
            allowed_origins=tuple(args.allow_origin),
            cors_origins=tuple(args.cors_origin),
            public_metrics=args.public_metrics,
            ui=args.ui,
            admin_key=args.admin_key or None,
            runtime_adapters=args.allow_runtime_adapters,
            load_on_startup=not args.lazy,
            idle_unload=args.idle_unload,
            max_loaded_models=args.max_loaded_models,
            memory_budget=args.memory_budget,
            unload_grace=args.unload_grace,
            lenient=args.lenient,
            max_body_memory=int(args.max_body_memory_mb * 1024 * 1024),
            tracing="off" if args.no_tracing else "auto",
            otlp_endpoint=args.otlp_endpoint,
            log_prompts=args.log_prompts,
        )
        # The models load on a thread of their own while Litestar, uvicorn and the server's
        # state import below (onnxruntime builds sessions without the GIL): start-up is the
        # longer of the two, not their sum.
        registry = model_registry(config)
        preload(config, registry)
        import uvicorn
        from uvicorn.config import LOGGING_CONFIG

        from ._state import OrtServe

        state = OrtServe(config, registry)

        from ._app import create_app
        from ._serving import ConnectionLimits, GuardedH11Protocol, default_max_connections, listen, raise_fd_limit

        app = create_app(config, state=state)
    except (ModelLoadError, ValueError, OSError) as exc:
        print(f"ortserve: {exc}", file=sys.stderr)
        return 2

    fd_limit = raise_fd_limit()
    try:
        sock = listen(args.host, args.port)
    except OSError as exc:
        print(f"ortserve: cannot listen on {args.host}:{args.port}: {exc.strerror}", file=sys.stderr)
        return 2
    port = sock.getsockname()[1]
    limits = ConnectionLimits(
        header_timeout=args.header_timeout,
        body_timeout=args.body_timeout,
        body_min_rate=args.body_min_rate,
        send_timeout=args.send_timeout,
        max_connections=args.max_connections or default_max_connections(fd_limit),
    )
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            log_level=args.log_level,
            # ortserve's own line per request (ortserve.access) replaces uvicorn's: it has the
            # request id, model and tokens. With JSON logs uvicorn's loggers go to the root's.
            access_log=False,
            log_config=None if args.log_format == "json" else LOGGING_CONFIG,
            # uvicorn's own deadline is the last resort (it then cancels silently);
            # _drain ends work in-band at the grace period itself.
            timeout_graceful_shutdown=args.grace_period + 2 * CUT_BACKSTOP,
            lifespan="on",
            http=GuardedH11Protocol.with_limits(limits),
            ws="none",  # no websocket routes: upgrade requests are served as plain HTTP
            # Typed int by uvicorn, but only ever handed to loop.call_later.
            timeout_keep_alive=args.keep_alive_timeout,
            h11_max_incomplete_event_size=args.max_header_size,
        )
    )
    # uvicorn turns SIGTERM/SIGINT into a graceful shutdown, then re-raises the signal
    # under the handlers it found; with these no-op handlers that ends in a clean exit 0.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: None)
    try:
        # Models load before the server starts, so a broken model is one clear line here
        # rather than a failed lifespan inside uvicorn.
        asyncio.run(_run(server, sock, port, args.ready_json, app.state.ortserve, args.grace_period))
    except ModelLoadError as exc:
        print(f"ortserve: {exc}", file=sys.stderr)
        return 2
    if not server.started:
        return 1
    return EXIT_WORK_CUT if app.state.ortserve.cut_requests else 0


async def _run(server: object, sock: socket.socket, port: int, ready_json: bool, state: OrtServe, grace: float) -> None:
    import uvicorn

    from ._serving import AcceptErrorLog

    assert isinstance(server, uvicorn.Server)
    AcceptErrorLog().install(asyncio.get_running_loop())
    reporter = asyncio.create_task(_report_conversions(state, ready_json))
    try:
        await _start_or_stop(state)
    finally:
        reporter.cancel()
        gc.enable()  # disabled for the start-up (_serve)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    watchdog = asyncio.create_task(_watch_parent(server))
    drain = asyncio.create_task(_drain(server, state, grace))
    try:
        while not server.started:
            if serving.done():
                serving.result()  # re-raise a startup failure
                return
            await asyncio.sleep(0.01)
        line = {"event": "ready", "host": sock.getsockname()[0], "port": port, "pid": os.getpid()}
        if ready_json:
            print(json.dumps(line), flush=True)
        else:
            page = f" (web page: http://{line['host']}:{port}{state.config.ui_path})" if state.config.ui else ""
            print(f"ortserve listening on http://{line['host']}:{port}/v1{page}", file=sys.stderr, flush=True)
        await serving
    finally:
        for task in (watchdog, drain):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def _start_or_stop(state: OrtServe) -> None:
    """Run the start-up (models load, files convert), or stop it at SIGTERM or SIGINT:
    conversions in progress end (their partial folders removed) and the process exits with
    128 + the signal's number. uvicorn handles the signals once it serves; before, the no-op
    handlers ``_serve`` installs would swallow them, and a minute's conversion could not be
    interrupted. A second signal exits at once."""
    loop = asyncio.get_running_loop()
    startup = asyncio.create_task(state.startup())
    came: list[signal.Signals] = []

    def stop(signum: signal.Signals) -> None:
        if came:
            os._exit(128 + signum)
        came.append(signum)
        startup.cancel()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop, signum)
    try:
        await startup
    except asyncio.CancelledError:
        if not came:
            raise
        print(f"ortserve: stopped by {came[0].name} while starting", file=sys.stderr, flush=True)
        await state.shutdown()
        raise SystemExit(128 + came[0]) from None
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
            signal.signal(signum, lambda *_: None)  # as _serve left it, for uvicorn to find


async def _report_conversions(state: OrtServe, as_json: bool) -> None:
    """While the models load before the server listens, say how far each conversion (a
    GGUF file, a checkpoint's build) has come: a log line every 10%, and with
    ``--ready-json`` an event line ``{"event": "converting", "model": ..., "progress": ...}``
    on stdout for each percent (a sidecar's host shows it, and knows the server is not stuck)."""
    told: dict[str, tuple[int, int]] = {}  # name -> (percent, tenth) last reported
    while True:
        for status in state.registry.status():
            if status.state != "converting" or status.progress is None:
                continue
            percent = int(status.progress * 100)
            last_percent, last_tenth = told.get(status.name, (-1, -1))
            if as_json and percent != last_percent:
                line = {"event": "converting", "model": status.name, "progress": round(status.progress, 3)}
                print(json.dumps(line), flush=True)
            if percent // 10 != last_tenth:
                logger.info("model %s: converting its source, %d%%", status.name, percent)
            told[status.name] = (percent, percent // 10)
        await asyncio.sleep(0.2)


async def _drain(server: object, state: OrtServe, grace: float) -> None:
    """Once a shutdown begins (uvicorn stops accepting and waits for requests), give
    in-flight work ``grace`` seconds; then end it in-band (streams get an error event and
    ``[DONE]``, other generations a 503), and cancel what still runs CUT_BACKSTOP seconds
    later. Anything ended here makes the exit code EXIT_WORK_CUT."""
    while not server.should_exit:  # type: ignore[attr-defined]
        await asyncio.sleep(0.05)
    await asyncio.sleep(grace)
    tasks = server.server_state.tasks  # type: ignore[attr-defined]  # the requests in flight
    if tasks:
        logger.warning("grace period of %g s is over: ending %d request(s) still in flight", grace, len(tasks))
        state.cut_work()
    await asyncio.sleep(CUT_BACKSTOP)
    left = [task for task in tasks if not task.done()]
    if left:
        logger.error("cancelling %d request(s) that did not end after the grace period", len(left))
        state.cut_requests += len(left)
        for task in left:
            task.cancel()


async def _watch_parent(server: object) -> None:
    """Exit when the process that spawned us dies (a sidecar must not outlive its host)."""
    recorded = os.environ.get(PARENT_PID_ENV)
    if not recorded:
        return
    parent = int(recorded)
    while True:
        await asyncio.sleep(0.5)
        if os.getppid() != parent and not _alive(parent):
            logger.warning("parent process %s is gone; shutting down", parent)
            server.should_exit = True  # type: ignore[attr-defined]
            return


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _pull(args: argparse.Namespace) -> int:
    from ortserve_client import HubReference, OrtServeError, pull

    try:
        reference = HubReference.parse("hf:" + args.repo.removeprefix("hf:"))
        assert reference is not None
        folder = pull(
            reference.repo_id,
            subfolder=reference.subfolder,
            allow_patterns=reference.allow_patterns,
            revision=args.revision,
        )
        path = reference.local_path(folder)
    except (OrtServeError, ValueError) as exc:
        print(f"ortserve: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


def _ls() -> int:
    rows = [(name, str(path)) for name, path in demo_models().items()]
    with contextlib.suppress(Exception):  # no cache yet, or an unreadable one: nothing to list
        from huggingface_hub import scan_cache_dir

        for repo in scan_cache_dir().repos:
            for revision in repo.revisions:
                snapshot = Path(revision.snapshot_path)
                found = [config.parent for config in snapshot.rglob("genai_config.json")]
                # GGUF files too (a split one by its first part), as `serve --model hf:...` names them
                found += [
                    f for f in snapshot.rglob("*.gguf") if not re.search(r"-(?!00001)\d{5}-of-\d{5}\.gguf$", f.name)
                ]
                rows += [(f"{repo.repo_id}/{path.relative_to(snapshot)}", str(path)) for path in found]
    for name, path in rows:
        print(f"{name}\t{path}")
    return 0


def _ps(args: argparse.Namespace) -> int:
    """``GET /v1/models`` of a running server as a table (what ``ollama ps`` shows)."""
    import time

    from ortserve_client import AsyncClient, OrtServeError
    from ortserve_client.protocol import Model

    async def fetch() -> list[Model]:
        async with AsyncClient(args.url, api_key=args.api_key, timeout=10.0, max_retries=0) as client:
            return list((await client.models.list()).data)

    try:
        models = asyncio.run(fetch())
    except OrtServeError as exc:
        print(f"ortserve: {exc}", file=sys.stderr)
        return 1
    now = time.time()
    header = ("NAME", "KIND", "STATUS", "ENGINE", "RESIDENT", "KV CACHE", "IN FLIGHT", "LAST USED", "UNLOADS")
    rows = [header]
    for m in models:
        rows.append(
            (
                m.id,
                m.kind or "-",
                m.status or "-",
                (m.engine or "-") + (" (int8 prefill)" if m.prefill_int8 else ""),
                _human_bytes(m.resident_bytes),
                _human_bytes(m.kv_cache_bytes)
                + (f" ({m.kv_cache_dtype})" if m.kv_cache_dtype not in (None, "float32") else ""),
                str(m.in_flight if m.in_flight is not None else "-"),
                _ago(now, m.last_used),
                _until(now, m.expires_at, m.status),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    return 0


def _human_bytes(count: int | None) -> str:
    if count is None:
        return "-"
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{count} B"


def _ago(now: float, moment: int | None) -> str:
    return "-" if moment is None else f"{max(0, round(now - moment))} s ago"


def _until(now: float, moment: int | None, status: str | None) -> str:
    if moment is not None:
        return f"in {max(0, round(moment - now))} s"
    return "never" if status == "ready" else "-"


if __name__ == "__main__":
    sys.exit(main())
