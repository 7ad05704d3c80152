"""Configuration of ``pdlb serve``: one pydantic model, loadable from YAML/TOML/JSON plus CLI flags.

Defaults of the resilience settings follow the SGLang router's service defaults (ANCHORS.md,
"SGLang cache_aware", last bullet): 5 retries with backoff 50 ms -> 30 s (x1.5, jitter 0.2) on
408/429/500/502/503/504; the circuit breaker opens after 10 failures, closes after 3 successes,
stays open 60 s; health checks every 60 s with a 5 s timeout.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, StrictBool, ValidationError, field_validator, model_validator

from balancer.config import RouterConfig
from balancer.service.broker_config import BrokerConfig
from balancer.validation import format_validation_error, syntax_error_line
from balancer.deadline_admission import wait_model_warning
from balancer.policies.base import policy_class
from balancer.service.admission_config import AdmissionSettings

WORKER_SPEC_SYNTAX = ("URL[,dp=N][,bootstrap=PORT|none][,kv=TOKENS][,events=tcp://HOST:PORT][,replay=tcp://HOST:PORT]"
                      "[,model=NAME]")


def zmq_endpoint_problem(endpoint: str) -> str | None:
    """Why ``endpoint`` cannot be a KV-event endpoint (``tcp://HOST:PORT``, ``ipc://PATH``), or ``None``."""
    if endpoint.startswith("ipc://") and len(endpoint) > 6:
        return None
    if not endpoint.startswith("tcp://"):
        return "a KV event endpoint must be tcp://HOST:PORT (or ipc://PATH)"
    host, sep, port = endpoint[6:].rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        return f"{endpoint!r} needs a host and a port 1..65535 (tcp://HOST:PORT, the engine's KV event publisher)"
    return None


MAX_URL_CHARS = 2048
"""Longest worker URL accepted."""
MAX_MODEL_NAME_CHARS = 1024
"""Longest model name a worker may be given (a model folder path)."""

MAX_DP_SIZE = 1024
"""Most DP ranks of one worker (wide-EP decode engines have 64-320); registering 1,024 ranks takes
the event loop about 50 ms (4,096 took 0.2-0.4 s, during which no client was served)."""
MAX_KV_CAPACITY_TOKENS = 2**40
"""Largest ``kv_capacity_tokens`` accepted (far beyond any engine; bounds arithmetic on it)."""


def redact_url(url: str) -> str:
    """``url`` with any user name and password replaced by ``***`` (for messages and logs)."""
    scheme, sep, rest = url.partition("://")
    netloc, slash, tail = rest.partition("/")
    if "@" in netloc:
        netloc = "***@" + netloc.rpartition("@")[2]
    return (scheme + sep + netloc + slash + tail)[:200]


def worker_url_problem(url: str) -> str | None:
    """Why ``url`` cannot be a worker's base URL, or ``None`` if it can.

    A worker URL is ``http(s)://host[:port]``: the scheme ``http`` or ``https``, a host and, if it
    names a port, an integer port 1..65535; no user name or password (they would be shown by
    ``/metrics`` and ``/workers``, which need no credentials), no path, query or fragment (the
    router appends the endpoint's path itself); at most :data:`MAX_URL_CHARS` characters of
    printable ASCII. It is parsed with :class:`yarl.URL`, as the HTTP client will parse it (so that
    a bad URL fails at startup, not as a 500 on every request). The message never repeats a
    password.
    """
    from yarl import URL  # aiohttp's own URL type

    if len(url) > MAX_URL_CHARS:
        return f"the URL is longer than {MAX_URL_CHARS} characters"
    if not url.isascii() or not url.isprintable() or " " in url:
        return "the URL must be printable ASCII without spaces"
    if not url.startswith(("http://", "https://")):
        scheme, sep, _ = url.partition("://")
        if sep and scheme:  # another scheme: an example made from it would be nonsense
            return f"the URL must start with http:// or https://, got scheme '{scheme[:20]}'"
        example = "10.0.0.5:30000" if "@" in url else url[:200]
        return f"the URL must start with http:// or https:// (e.g. 'http://{example}')"
    parts = urlsplit(url)
    if "@" in parts.netloc:
        return "the URL must not contain a user name or password (it would be shown by /metrics and /workers)"
    if parts.path not in ("", "/") or parts.query or parts.fragment or "?" in url or "#" in url:
        return "the URL must be the engine's base URL, scheme://host:port, without a path, query or fragment"
    hostport = parts.netloc
    after_host = hostport.rpartition("]")[2] if hostport.startswith("[") else hostport
    port_text = after_host.partition(":")[2] if ":" in after_host else None
    if port_text is not None and port_text != "":
        if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
            return f"port {port_text!r} is not an integer 1..65535"
    try:
        parsed = URL(url)
    except ValueError as e:
        if "host is required" in str(e):
            return "the URL has no host (e.g. 'http://10.0.0.5:30000')"
        return f"not a valid URL ({e})"
    if not parsed.host:
        return "the URL has no host (e.g. 'http://10.0.0.5:30000')"
    return None


class WorkerConfig(BaseModel):
    """One engine behind the router.

    Attributes:
        url: base URL, e.g. ``http://10.0.0.5:30000`` (no trailing slash needed).
        role: ``prefill``, ``decode`` or ``mixed``.
        dp_size: attention DP ranks of the engine; each is a routing target. With ``dp_size > 1``
            the router names the rank (SGLang ``data_parallel_rank`` body field, vLLM
            ``X-data-parallel-rank`` header).
        bootstrap_port: SGLang prefill engines' KV bootstrap port (``--disaggregation-bootstrap-port``);
            ``None`` sends ``bootstrap_port: null``.
        kv_capacity_tokens: KV capacity per DP rank in tokens, for KV-aware policies (0 = unknown).
        events: the engine's KV event publisher (vLLM ``--kv-events-config`` ``endpoint``, SGLang
            ``--kv-events-config``), ``tcp://HOST:PORT`` of DP rank 0; rank ``r`` on PORT + ``r``.
            Used with ``index_mode`` ``events`` or ``hybrid`` (:mod:`balancer.service.kv_subscriber`).
        replay: the engine's replay endpoint (``replay_endpoint``), rank ``r`` on PORT + ``r``;
            lets the router fill gaps and catch up after a late start.
        served_model_name: the model name this engine accepts (``model=NAME`` in a worker spec);
            a request naming the router's ``served_model_name`` (its alias) is sent with this name
            instead. ``None``: discovered from the engine's ``/v1/models``
            (:mod:`balancer.service.engine_caps`).
    """

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    url: str
    role: Literal["prefill", "decode", "mixed"]
    dp_size: int = Field(1, ge=1, le=MAX_DP_SIZE)
    bootstrap_port: int | None = Field(None, ge=1, le=65535)
    kv_capacity_tokens: int = Field(0, ge=0, le=MAX_KV_CAPACITY_TOKENS)
    events: str | None = None
    replay: str | None = None
    served_model_name: str | None = Field(None, min_length=1, max_length=MAX_MODEL_NAME_CHARS)

    @field_validator("events", "replay")
    @classmethod
    def _check_endpoint(cls, v: str | None) -> str | None:
        if v is not None and (problem := zmq_endpoint_problem(v.strip())) is not None:
            raise ValueError(problem)
        return v.strip() if v is not None else None

    @model_validator(mode="after")
    def _replay_needs_events(self) -> WorkerConfig:
        if self.replay is not None and self.events is None:
            raise ValueError(f"worker {self.url}: replay is set but events is not (give the publisher's events endpoint)")
        return self

    @field_validator("url")
    @classmethod
    def _check_url(cls, v: str) -> str:
        v = v.strip().rstrip("/")
        if (problem := worker_url_problem(v)) is not None:
            raise ValueError(f"worker url {redact_url(v)!r}: {problem}")
        return v


class RetryConfig(BaseModel):
    """Retries of a request that failed before any byte reached the client (new pair, new room).

    Backoff before retry ``k`` (1-based): ``min(max_backoff_s, initial_backoff_s * multiplier**(k-1))``
    times a uniform factor in ``[1 - jitter, 1 + jitter]``.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    max_retries: int = Field(5, ge=0)
    initial_backoff_s: float = Field(0.05, ge=0)
    max_backoff_s: float = Field(30.0, ge=0)
    backoff_multiplier: float = Field(1.5, ge=1.0)
    jitter: float = Field(0.2, ge=0, le=1)
    retry_statuses: list[int] = Field(default_factory=lambda: [408, 429, 500, 502, 503, 504])


class CircuitBreakerConfig(BaseModel):
    """Per-worker breaker: ``failure_threshold`` consecutive failed client requests open it (a
    client request counts once per worker however many attempts it made, and an error answer the
    request itself caused counts not at all); it goes half-open (routable: trial requests) after
    ``open_duration_s`` or as soon as a health probe passes (with health checks on, open and
    unhealthy workers are probed every ``probe_interval_s``); ``success_threshold`` successes
    close it, one failure reopens it. So traffic returns about ``probe_interval_s`` after a worker
    recovers, not after a fixed open period (SGLang's router keeps a breaker open 60 s)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    enabled: bool = True
    failure_threshold: int = Field(10, ge=1, le=1_000_000)
    success_threshold: int = Field(3, ge=1, le=1_000_000)
    open_duration_s: float = Field(5.0, gt=0, le=86_400)
    probe_interval_s: float = Field(1.0, gt=0, le=3600)


class HealthCheckConfig(BaseModel):
    """Active health checks: ``GET {url}{endpoint}`` every ``interval_s``; a worker is unhealthy
    after ``failure_threshold`` consecutive failures and healthy again after ``success_threshold``
    consecutive successes."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    enabled: bool = True
    interval_s: float = Field(60.0, gt=0)
    timeout_s: float = Field(5.0, gt=0)
    endpoint: str = "/health"
    failure_threshold: int = Field(3, ge=1)
    success_threshold: int = Field(2, ge=1)


class KvEventsConfig(BaseModel):
    """The KV-event subscriber (workers with ``events``; :mod:`balancer.service.kv_subscriber`).

    Attributes:
        stale_after_s: a DP rank whose events stopped this long is marked stale (log, metric);
            (0, 86,400] s.
        replay_timeout_s: a replay request that takes longer is given up (counted); the source
            then waits this long (doubling, at most 60 s) before its next replay, applying its live
            batches meanwhile; (0, 600] s.
        max_concurrent_replays: replays of different DP ranks running at once (each source's
            replay is independent: one that never answers delays no other source's events).
        translator_capacity_blocks: engine blocks remembered per DP rank for hash translation.
        runner: ``process`` (default: decode and translate in a child process, off the router's
            GIL) or ``thread`` (in a thread of the router process; no extra process).
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    runner: Literal["process", "thread"] = "process"
    stale_after_s: float = Field(60.0, gt=0, le=86_400.0)
    replay_timeout_s: float = Field(2.0, gt=0, le=600.0)
    max_concurrent_replays: int = Field(8, ge=1, le=1024)
    translator_capacity_blocks: int = Field(1 << 20, ge=1)


class LoadScrapeConfig(BaseModel):
    """Scraping the engines' Prometheus ``/metrics`` into engine load reports
    (:mod:`balancer.service.load_scraper`): running and waiting requests and KV cache usage per DP
    rank, so several independent routers see the engines' whole load, not their own share.

    Attributes:
        enabled: scrape at all (off by default: one extra GET per worker per interval).
        interval_s: seconds between scrapes of each worker.
        timeout_s: per scrape.
        max_age_s: a report older than this stops counting (the engine stopped answering).
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    enabled: bool = False
    interval_s: float = Field(1.0, gt=0)
    timeout_s: float = Field(2.0, gt=0)
    max_age_s: float = Field(10.0, gt=0)


#: The keys of the ``router:`` section that were top-level settings before it (still read there).
LEGACY_ROUTER_KEYS = ("prefill_policy", "decode_policy", "cost_model", "learn_cost_model", "block_size",
                      "pd_min_uncached_tokens", "index_capacity_blocks", "index_ttl_s", "index_total_capacity_blocks",
                      "index_mode", "speculative_ttl_s", "seed")


def move_legacy_router_keys(data: dict[str, Any], override: bool = False) -> tuple[dict[str, Any], tuple[str, ...]]:
    """``data`` (a service config mapping) with its top-level :data:`LEGACY_ROUTER_KEYS` moved into
    its ``router`` section, and the keys moved (a new dict; ``data`` is not changed).
    ``override``: the top-level values replace the section's (command-line flags over a file).

    Raises:
        ValueError: a key given both at the top level and in ``router:`` (unless ``override``),
            or a ``router`` that is not a mapping.
    """
    moved = tuple(k for k in LEGACY_ROUTER_KEYS if k in data)
    if not moved:
        return data, ()
    router = data.get("router") or {}
    if isinstance(router, RouterConfig):
        router = {k: getattr(router, k) for k in RouterConfig.model_fields if k in router.model_fields_set}
    if not isinstance(router, dict):
        raise ValueError(f"router: must be a mapping of router settings, got {type(router).__name__}")
    both = [k for k in moved if k in router]
    if both and not override:
        raise ValueError(f"{', '.join(both)} given both at the top level and under router: (keep the router: one)")
    out = {k: v for k, v in data.items() if k not in moved}
    out["router"] = {**router, **{k: data[k] for k in moved}}
    return out, moved


class ServiceConfig(BaseModel):
    """Everything ``pdlb serve`` needs.

    Attributes:
        host / port: where the router listens.
        pd_protocol: ``sglang`` (both legs at once with bootstrap fields), ``vllm`` (prefill then
            decode with ``kv_transfer_params``) or ``none`` (mixed workers only). ANCHORS.md,
            "PD request flows".
        workers: the engines at start (more can be added with the admin API).
        router: the router's settings (:class:`balancer.config.RouterConfig`: policies, block
            size, prefix index, cost model and its online fit, seed; defaults in
            :mod:`balancer.config`). Process ``i`` of ``processes`` seeds its router with
            ``router.seed + i``. The same keys at the top level (the form before the ``router:``
            section: ``prefill_policy``, ``block_size``, ``index_mode``, ...) are still read, into
            this section, with a deprecation warning (:func:`config_warnings`).
        chat_engine: whose chat rendering ``tokenizer_path``'s template reproduces (``vllm``, ``sglang``:
            they join text content parts and continue a final message differently; see
            :meth:`balancer.service.prompt.ChatTemplate.render_for`).
        chars_per_token / tokenizer_path: see :mod:`balancer.service.prompt` (prompts are hashed
            in blocks of ``router.block_size`` tokens).
        kv_events: the KV-event subscriber's settings (:class:`KvEventsConfig`).
        lora_adapters: LoRA adapter names the engines serve (requests choose one with ``model``):
            a request for one hashes its prompt from that adapter's chain root, as the engines'
            KV events for it are translated (:func:`balancer.kv_translate.chain_root`), so
            adapter and base-model caches are never conflated.
        load_scrape: engine metrics scraping (:class:`LoadScrapeConfig`).
        admission: deadline admission (:class:`balancer.service.admission_config.AdmissionSettings`;
            off by default).
        broker: routers on several hosts sharing in-flight load (and approximate-mode decisions)
            through a NATS broker (:class:`balancer.service.broker_config.BrokerConfig`; off by default).
        request_timeout_s: total time for one client request including retries (504 after).
        connect_timeout_s: TCP connect timeout to a worker.
        upstream_client: the HTTP client of the engine legs: ``lean`` (default; keep-alive pool
            on asyncio protocols with the ``httptools`` parser, :mod:`balancer.service.upstream`)
            or ``aiohttp`` (aiohttp's client session, the fallback). Same failure handling either
            way; ``https://`` workers use aiohttp's client with either. docs/serving.md,
            "Upstream client".
        http_front: the HTTP server of the generation endpoints: ``lean`` (default;
            :mod:`balancer.service.lean_front`: ``httptools`` serves the common generation request,
            and a connection goes to aiohttp's server for anything else) or ``aiohttp`` (aiohttp's
            server for every request). docs/serving.md, "HTTP front".
        connection_placement: with several ``processes``, where the parent places client
            connections: ``follow_load`` (default; on as few processes as the load needs, the
            others' connections given back with ``Connection: close`` at their next answer:
            :mod:`balancer.service.processes.placement`; needs Linux's ``/proc``, else round
            robin) or ``round_robin`` (every process in turn, never given back).
        placement_target_util: with ``connection_placement: follow_load``, the cores per active
            process the active set is sized for (0.3-0.95, default 0.7): ``k = ceil(load / it)``,
            growing at once over half way from it to a whole core. Higher packs the load onto fewer,
            busier processes; 0.9 measured no better than the default on 16 cores (0.94x CPU per
            request in SGLang PD at 0.88x req/s, 0.83x req/s in regular). :mod:`balancer.service.processes.placement`;
            docs/serving.md, "Connection placement".
        pin_processes: with several ``processes``, run router process ``i`` on one CPU only, the
            ``i``-th (wrapping) of the CPUs ``pdlb serve`` may use (Linux; default False: any CPU
            of the set). :mod:`balancer.service.processes.pinning`; docs/serving.md, "Router
            processes on their own CPUs".
        first_byte_timeout_s: per attempt and leg, seconds from sending a leg to its response
            headers (and, for a streamed decode leg, its first body chunk); a leg that misses it
            fails the attempt, which is retried on a new pair and counts against the worker's
            circuit breaker. Engines send a non-streaming answer only when generation ends, so
            set it above your longest non-streaming generation. ``None`` (default): off.
        stream_first_chunk_timeout_s: when ``first_byte_timeout_s`` is off, the same bound for
            streamed decode legs only (headers and first chunk; default 120 s, above
            ``prefill_timeout_s``: a streamed leg's first token follows its prefill), so a wedged
            streamed decode costs a request at most that long by default; non-streaming legs
            answer only when generation ends and are not bounded by it. ``None``: off.
        nonstream_timeout_s: when ``first_byte_timeout_s`` is off, a non-streamed decode (or
            mixed) leg must answer in full within ``nonstream_timeout_s + max_tokens *
            nonstream_timeout_per_token_s`` seconds (``max_tokens``: the request's output limit,
            else ``default_max_tokens``; default 60 s + 0.25 s per token, i.e. generation at 4
            tokens/s or faster); a miss fails the attempt like a first-byte timeout (retried,
            charged to the worker's circuit breaker), so an engine that passes health checks but
            never answers costs a short request about a minute, not ``request_timeout_s``.
            ``None``: off (the request is then bounded by ``request_timeout_s`` alone; a leg
            still waiting for its answer when that expires is charged to its worker too).
        nonstream_timeout_per_token_s: see ``nonstream_timeout_s`` (seconds per output token).
        prefill_timeout_s: per attempt, seconds from sending a prefill leg (PD) to its complete
            answer (it answers once the prompt is prefilled); a miss fails the attempt like a
            first-byte timeout. Default 60 s (well above the prefill of a 128k-token prompt on
            one node); ``None``: off.
        max_tokens_limit: the largest output-token limit a request may ask for (``max_tokens``,
            ``max_completion_tokens``, ``sampling_params.max_new_tokens``); larger gets 400.
        max_model_len: if set, a request whose prompt tokens (estimated without a tokenizer)
            plus output limit exceed it gets 400, as the engine would refuse it.
        client_idle_timeout_s: a client connection that has not sent a complete request's
            headers this long after it opened or after its last answer is closed (aiohttp's
            keep-alive timeout, which also bounds a slow header read; its default is an hour).
        body_read_timeout_s: the most time a client may take to send a request body (408).
        max_connections: client connections held at once by each router process; more are
            closed at once (a slowloris flood cannot exhaust file descriptors). Lowered at start
            where the open-file limit cannot hold it (:mod:`balancer.service.fd_limit`).
        allow_unauthenticated_admin: allow a non-loopback ``host`` without ``admin_api_key``
            (the admin API then answers loopback peers only; behind a reverse proxy on the same
            host every client is a loopback peer, so set ``admin_api_key`` there).
        max_body_bytes: larger request bodies get 413.
        admin_api_key: bearer token for ``/workers``; without one the admin API answers loopback
            clients only.
        served_model_name: the id ``/v1/models`` lists; ``None`` asks a worker. It is the alias
            clients use: a request naming it goes to each engine under that engine's own name
            (the worker's ``served_model_name``, else the one its ``/v1/models`` listed).
        shutdown_timeout_s: graceful shutdown drains in-flight requests for at most this long.
        default_max_tokens: the output length assumed for load accounting when a request names none.
        processes: router processes behind the port (the parent accepts client connections and
            hands them to the processes in turn: :mod:`balancer.service.handoff`). In-flight load is shared through shared memory
            (:mod:`balancer.service.processes.shared_load`); with workers' KV ``events`` every process consumes
            them, so prefix views agree; in approximate mode each process sends its decisions to
            the others (:mod:`balancer.service.processes.shared_prefix`); breakers are per process;
            ``/metrics`` aggregates all of them; admin API changes are applied by every process
            (:mod:`balancer.service.processes.shared_admin`). ``None`` (default): ``pdlb serve`` starts one
            per core it may run on, one per four cores when a worker runs on the same host
            (:func:`balancer.service.launch.default_processes`); round robin counts per process (each
            process takes the candidates in turn, so N processes split a short run unevenly by up
            to N requests per worker; load-aware policies read the shared load); an app built
            in process (:func:`balancer.service.app.create_app`) is one. See docs/serving.md,
            "Overhead".
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    pd_protocol: Literal["sglang", "vllm", "none"] = "sglang"
    workers: list[WorkerConfig] = Field(default_factory=list)
    router: RouterConfig = RouterConfig()
    chars_per_token: float = Field(4.0, gt=0)
    tokenizer_path: str | None = None
    chat_engine: Literal["vllm", "sglang"] = "vllm"
    lora_adapters: list[str] = Field(default_factory=list)
    kv_events: KvEventsConfig = KvEventsConfig()
    load_scrape: LoadScrapeConfig = LoadScrapeConfig()
    admission: AdmissionSettings = AdmissionSettings()
    broker: BrokerConfig = BrokerConfig()
    request_timeout_s: float = Field(600.0, gt=0)
    connect_timeout_s: float = Field(5.0, gt=0)
    upstream_client: Literal["lean", "aiohttp"] = "lean"
    http_front: Literal["aiohttp", "lean"] = "lean"
    connection_placement: Literal["follow_load", "round_robin"] = "follow_load"
    pin_processes: StrictBool = False
    placement_target_util: float = Field(0.7, ge=0.3, le=0.95)
    placement_even_out: StrictBool = False
    first_byte_timeout_s: float | None = Field(None, gt=0)
    stream_first_chunk_timeout_s: float | None = Field(120.0, gt=0)
    prefill_timeout_s: float | None = Field(60.0, gt=0)
    nonstream_timeout_s: float | None = Field(60.0, gt=0)
    nonstream_timeout_per_token_s: float = Field(0.25, ge=0)
    max_tokens_limit: int = Field(1_048_576, ge=1, le=2**31 - 1)
    max_model_len: int | None = Field(None, ge=2, le=2**40)
    allow_unauthenticated_admin: bool = False
    client_idle_timeout_s: float = Field(30.0, gt=0, le=3600)
    body_read_timeout_s: float = Field(30.0, gt=0, le=3600)
    max_connections: int = Field(10_000, ge=1, le=1_000_000)
    max_body_bytes: int = Field(32 * 1024 * 1024, ge=1024)
    retry: RetryConfig = RetryConfig()
    circuit_breaker: CircuitBreakerConfig = CircuitBreakerConfig()
    health_check: HealthCheckConfig = HealthCheckConfig()
    admin_api_key: str | None = None
    served_model_name: str | None = Field(None, min_length=1, max_length=MAX_MODEL_NAME_CHARS)  # "" was "no alias" (R10)
    shutdown_timeout_s: float = Field(30.0, ge=0)
    default_max_tokens: int = Field(16, ge=1)
    processes: int | None = Field(None, ge=1, le=256)

    #: top-level keys found in the data that belong to ``router:`` (moved there; deprecated)
    _legacy_router_keys: tuple[str, ...] = PrivateAttr(default=())

    @model_validator(mode="wrap")
    @classmethod
    def _legacy_keys(cls, data: Any, handler: Any) -> ServiceConfig:
        moved: tuple[str, ...] = ()
        if isinstance(data, dict):
            data, moved = move_legacy_router_keys(data)
        cfg = handler(data)
        if moved:
            cfg._legacy_router_keys = moved
        return cfg

    @model_validator(mode="after")
    def _check_workers(self) -> ServiceConfig:
        if not self.admin_api_key and not self.allow_unauthenticated_admin and not _loopback_host(self.host):
            raise ValueError(f"host {self.host!r} is not a loopback address and no admin_api_key is set: anyone who "
                             "can reach the router could add or remove workers through a reverse proxy on the same "
                             "host; set admin_api_key (--admin-api-key), or allow_unauthenticated_admin "
                             "(--allow-unauthenticated-admin) to accept that")
        urls = [w.url for w in self.workers]
        dup = {u for u in urls if urls.count(u) > 1}
        if dup:
            raise ValueError(f"duplicate worker url(s) {', '.join(sorted(dup))}: list each engine once")
        if self.pd_protocol == "none" and any(w.role == "prefill" for w in self.workers):
            raise ValueError("pd_protocol 'none' cannot use prefill workers; use mixed workers or pick sglang/vllm")
        return self


def _loopback_host(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bootstrap_warning(pd_protocol: str, worker: WorkerConfig) -> str | None:
    """The warning for an SGLang PD prefill worker given without a bootstrap port, else ``None``.

    With ``pd_protocol`` ``sglang`` each request tells the decode engine where to fetch the KV
    (``bootstrap_host`` and the prefill's ``bootstrap_port``); a prefill worker whose
    ``bootstrap_port`` was left out sends ``bootstrap_port: null``, which a decode engine that
    needs the port rejects, so every PD request fails on the decode leg (502). ``bootstrap=none``
    (``bootstrap_port: null`` in a config file) asks for that null on purpose and is not warned
    about.
    """
    if pd_protocol != "sglang" or worker.role != "prefill" or "bootstrap_port" in worker.model_fields_set:
        return None
    return (f"warning: prefill worker {worker.url} has no bootstrap port: with pd_protocol sglang its requests "
            f"carry bootstrap_port null and decode engines that need it fail every PD request (502); give the "
            f"engine's --disaggregation-bootstrap-port as {worker.url},bootstrap=PORT (bootstrap_port: PORT in "
            f"a config file), or bootstrap=none to send null on purpose")


def config_warnings(cfg: ServiceConfig) -> list[str]:
    """Warning lines for a config that starts but cannot serve PD requests as given: SGLang
    prefill workers without a bootstrap port (:func:`bootstrap_warning`), and a PD protocol with
    prefill workers but no decode/mixed worker (every request 503) or decode workers but no prefill
    worker (requests go to PD decode engines alone). No workers at all is warned about elsewhere."""
    out = [w for w in (bootstrap_warning(cfg.pd_protocol, wc) for wc in cfg.workers) if w is not None]
    if cfg._legacy_router_keys:
        out.append(f"warning: deprecated top-level setting(s) {', '.join(cfg._legacy_router_keys)}: they are router "
                   f"settings now; put them under router: (read there this time)")
    index_mode = cfg.router.index_mode
    if index_mode != "approximate":
        blind = [w.url for w in cfg.workers if w.events is None]
        if blind:
            out.append(f"warning: index_mode {index_mode} but no events endpoint for {', '.join(blind)}: the router "
                       f"never learns what those workers cache" + (" (beyond its own routed prompts for "
                       f"{cfg.router.speculative_ttl_s:g} s)" if index_mode == "hybrid" else "")
                       + "; give URL,events=tcp://HOST:PORT")
    elif any(w.events is not None for w in cfg.workers):
        out.append("warning: workers have events endpoints but index_mode is approximate: their KV events are not "
                   "used (set --index-mode events or hybrid)")
    if cfg.admission.enabled:
        line = wait_model_warning(cfg.admission.wait_model,
                                  {"prefill": policy_class(cfg.router.prefill_policy.name),
                                   "decode": policy_class(cfg.router.decode_policy.name)})
        if line is not None:
            out.append(line)
    if cfg.chat_engine != "vllm" and cfg.tokenizer_path is None:
        out.append(f"warning: chat_engine {cfg.chat_engine} has no effect without a tokenizer: chat prompts are hashed "
                   f"as text chunks (give --tokenizer MODEL_DIR to render them as {cfg.chat_engine} does)")
    if cfg.pd_protocol == "none" or not cfg.workers:
        return out
    n = {r: sum(1 for w in cfg.workers if w.role == r) for r in ("prefill", "decode", "mixed")}
    if n["prefill"] and not (n["decode"] or n["mixed"]):
        out.append(f"warning: pd_protocol {cfg.pd_protocol} with {n['prefill']} prefill worker(s) but no decode worker: "
                   f"every request gets 503 until one is added (--decode URL or POST /workers)")
    elif n["decode"] and not n["prefill"]:
        out.append(f"warning: pd_protocol {cfg.pd_protocol} with {n['decode']} decode worker(s) but no prefill worker: "
                   f"requests go to the decode workers alone, which PD decode engines reject; add --prefill URL, "
                   f"or serve aggregated engines with --pd-protocol none --mixed URL")
    return out


def load_service_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> ServiceConfig:
    """Read a config file (``.yaml``/``.yml``, ``.toml``, ``.json``) and apply ``overrides``
    (top-level keys, e.g. from CLI flags; ``None`` values are ignored).

    Raises:
        ValueError: unreadable file, unknown suffix, or invalid settings (one line,
            ``"<file>: <field.path>: <problem>"``, problems joined by ``"; "``; see
            :func:`balancer.validation.format_validation_error`).
    """
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        try:
            text = p.read_text()
            if p.suffix in (".yaml", ".yml"):
                data = yaml.safe_load(text) or {}
            elif p.suffix == ".toml":
                data = tomllib.loads(text)
            elif p.suffix == ".json":
                data = json.loads(text)
            else:
                raise ValueError(f"unknown config file type {p.suffix!r} (use .yaml, .toml or .json)")
        except OSError as e:
            raise ValueError(f"{p}: {e}") from e
        except (yaml.YAMLError, tomllib.TOMLDecodeError, json.JSONDecodeError) as e:  # one line, file:line:col
            raise ValueError(syntax_error_line(str(p), e)) from None
        if not isinstance(data, dict):
            raise ValueError(f"{p}: the top level must be a mapping")
    for k, v in (overrides or {}).items():
        if v is not None:
            data[k] = v
    try:
        return ServiceConfig.model_validate(data)
    except ValidationError as e:  # one line per problem, "did you mean" for unknown fields
        raise ValueError(format_validation_error(e, str(path) if path is not None else None, ServiceConfig)) from None


_SPEC_KEYS = {"dp": "dp_size", "dp_size": "dp_size", "bootstrap": "bootstrap_port", "bootstrap_port": "bootstrap_port",
              "kv": "kv_capacity_tokens", "kv_capacity_tokens": "kv_capacity_tokens", "events": "events",
              "replay": "replay", "model": "served_model_name", "served_model_name": "served_model_name"}


def _spec_int(v: str) -> int | None:
    try:
        return int(v)
    except ValueError:
        return None


def parse_worker_spec(text: str, role: str) -> dict[str, Any]:
    """One ``--prefill/--decode/--mixed`` value, ``URL[,dp=N][,bootstrap=PORT|none][,kv=TOKENS]``,
    as :class:`WorkerConfig` fields.

    Example: ``parse_worker_spec("http://10.0.0.1:30000,dp=8,bootstrap=8998", "prefill")`` ->
    ``{"url": "http://10.0.0.1:30000", "role": "prefill", "dp_size": 8, "bootstrap_port": 8998}``.

    Raises:
        ValueError: ``"worker spec '<text>': <problem>"`` naming the bad part: a URL without
            ``http://``/``https://``, without a host or with a port that is not an integer 1..65535
            (:func:`worker_url_problem`), an unknown or repeated key, or a value that is not an integer
            in range (``dp`` >= 1 DP ranks, ``bootstrap`` a port 1..65535 or ``none``, ``kv`` >= 0
            tokens of KV capacity per DP rank, ``events``/``replay`` a ``tcp://HOST:PORT`` KV event
            endpoint, :func:`zmq_endpoint_problem`).
    """
    def bad(why: str) -> ValueError:
        return ValueError(f"worker spec {redact_url(text)!r}: {why}")

    parts = [p.strip() for p in text.split(",")]
    url = parts[0].rstrip("/")
    if not url:
        raise bad(f"no URL (syntax: {WORKER_SPEC_SYNTAX})")
    if (problem := worker_url_problem(url)) is not None:
        raise bad(problem)
    out: dict[str, Any] = {"url": url, "role": role}
    for i, part in enumerate(parts[1:], 2):
        if not part:
            where = "a trailing comma" if i == len(parts) else "two commas in a row"
            raise bad(f"item {i} is empty ({where}) (syntax: {WORKER_SPEC_SYNTAX})")
        k, _, v = part.partition("=")
        k, v = k.strip(), v.strip()
        key = _SPEC_KEYS.get(k)
        if key is None:
            raise bad(f"unknown option {part!r} (syntax: {WORKER_SPEC_SYNTAX})")
        if key in out:
            raise bad(f"{k} given more than once")
        if key == "served_model_name":
            if not v or len(v) > MAX_MODEL_NAME_CHARS or not v.isprintable():
                raise bad(f"model must be 1..{MAX_MODEL_NAME_CHARS} printable characters")
            out[key] = v
            continue
        if key in ("events", "replay"):
            if (problem := zmq_endpoint_problem(v)) is not None:
                raise bad(f"{k}: {problem}")
            out[key] = v
            continue
        n = _spec_int(v)
        if key == "bootstrap_port":
            if v.lower() == "none":
                out[key] = None
                continue
            if n is None or not 1 <= n <= 65535:
                raise bad(f"bootstrap must be a port number 1..65535 or none, got {v!r}")
        elif key == "dp_size":
            if n is None or not 1 <= n <= MAX_DP_SIZE:
                raise bad(f"dp must be an integer number of DP ranks 1..{MAX_DP_SIZE}, got {v[:20]!r}")
        elif n is None or not 0 <= n <= MAX_KV_CAPACITY_TOKENS:
            raise bad(f"kv must be an integer number of tokens 0..{MAX_KV_CAPACITY_TOKENS}, got {v[:20]!r}")
        out[key] = n
    return out
