"""``pdlb serve`` (and ``pdlb-serve``, the same command for an install with only the ``serve``
extra): the router service's flags, merged over a ``--config`` file into a
:class:`balancer.service.config.ServiceConfig` (flags win), then
:func:`balancer.service.launch.serve`.

Imports nothing of the simulator or of rich, so that ``pip install 'pdlb[serve]'`` runs it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING

from balancer import kernels
from balancer.cost_model import DEFAULT_COST_MODEL, CostModel
from balancer.policies import available_policies
from balancer.prefill_cadence import chunks_in_parallel
from balancer.service.config import (WORKER_SPEC_SYNTAX, ServiceConfig, load_service_config, move_legacy_router_keys,
                                     parse_worker_spec)
from balancer.service.launch import LOCAL_ENGINE_CORE_SHARE, default_processes, event_loop_factory, serve
from pdlb_cli.admission_args import add_admission_args, admission_overrides, flag_names

if TYPE_CHECKING:  # the simulator's dependency: pdlb-serve runs without it
    from rich.console import Console


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``pdlb serve`` on the top-level subparsers.

    Options that are also config-file settings default to ``None`` here (so that a ``--config``
    value is kept unless the flag is given); their help states the :class:`ServiceConfig` default.
    """
    d = ServiceConfig()
    policies = ", ".join(available_policies())
    p = subparsers.add_parser(
        "serve", help="run the PD router (OpenAI-compatible HTTP proxy)",
        description="Route OpenAI / SGLang requests to prefill and decode engines with pdlb's policies. "
                    f"Workers: {WORKER_SPEC_SYNTAX} (dp: attention DP ranks of the engine; bootstrap: SGLang "
                    "prefill KV bootstrap port; kv: KV capacity per DP rank in tokens, for KV-aware policies); "
                    "repeat --prefill/--decode/--mixed or list several specs after one. Flags override --config. "
                    "Prints 'pdlb serve ready on http://HOST:PORT ...' once listening. Environment: "
                    "PDLB_KERNELS=off runs the policies' numpy code instead of their compiled kernels (same "
                    "decisions) in every router process.")
    p.add_argument("--config", metavar="FILE",
                   help="YAML/TOML/JSON config file, schema ServiceConfig (see docs/serving.md); flags override it "
                        "(default: none)")
    p.add_argument("--host", help=f"bind address (default: {d.host})")
    p.add_argument("--port", type=int, help=f"TCP port; 0 picks a free one (default: {d.port})")
    p.add_argument("--pd-protocol", choices=["sglang", "vllm", "none"],
                   help="PD wire protocol: sglang (both legs at once, bootstrap room), vllm (prefill, then decode "
                        f"with kv_transfer_params), none (mixed workers only) (default: {d.pd_protocol})")
    for role, what in (("prefill", "prefill engine(s)"), ("decode", "decode engine(s)"),
                       ("mixed", "mixed (aggregated, prefill + decode) engine(s)")):
        p.add_argument(f"--{role}", action="extend", nargs="+", default=[], metavar="SPEC",
                       help=f"{what}, each {WORKER_SPEC_SYNTAX}; the flag can be repeated (default: none)")
    p.add_argument("--prefill-policy", metavar="NAME[:K=V,...]",
                   help=f"prefill-pool routing policy with optional parameters (e.g. cache_aware:cache_threshold=0.5; "
                        f"'pdlb policies' lists them), one of: {policies} (default: {d.router.prefill_policy.name})")
    p.add_argument("--decode-policy", metavar="NAME[:K=V,...]",
                   help=f"decode- and mixed-pool routing policy, same names (default: {d.router.decode_policy.name}, "
                        "whatever --prefill-policy is; note that 'pdlb sim run --policy P' uses P for both pools)")
    p.add_argument("--cost-model", metavar="FILE",
                   help="TOML/JSON cost-model table for ep_aware, as 'pdlb sim cost-model --scenario NAME' writes it "
                        "(default: a generic DeepSeek-V3-class model, refitted online)")
    p.add_argument("--no-learn-cost-model", action="store_true",
                   help="keep the cost model fixed instead of refitting it from observed timings (default: learn)")
    p.add_argument("--block-size", type=int, metavar="TOKENS",
                   help=f"tokens per hashed prefix block of the router's prefix index (default: {d.router.block_size}; "
                        "the simulator's scenarios use 512, the Mooncake traces' block size; see docs/serving.md)")
    p.add_argument("--tokenizer", dest="tokenizer_path", metavar="MODEL_DIR_OR_TOKENIZER_JSON",
                   help="local model folder (tokenizer.json + tokenizer_config.json with its chat template) or a "
                        "tokenizer.json: hash the engine's real token blocks, chat requests rendered with the model's "
                        "chat template (needs 'tokenizers', 'jinja2') (default: none, hash "
                        f"chunks of block_size * {d.chars_per_token:g} characters)")
    p.add_argument("--chat-engine", choices=["vllm", "sglang"],
                   help="whose chat rendering --tokenizer reproduces: vllm or sglang (they join text content parts "
                        "and continue a final message differently) (default: %s)" % d.chat_engine)
    p.add_argument("--index-mode", choices=["approximate", "events", "hybrid"],
                   help="prefix index: approximate (what the router routed), events (the engines' KV events, workers' "
                        "events=tcp://HOST:PORT), hybrid (events plus the router's own routed prompts for "
                        f"--speculative-ttl-s) (default: {d.router.index_mode})")
    p.add_argument("--speculative-ttl-s", type=float, metavar="SECONDS",
                   help=f"hybrid mode: how long a routed prompt counts as cached before its engine announces it "
                        f"(default: {d.router.speculative_ttl_s:g})")
    p.add_argument("--scrape-load", action="store_true", default=None,
                   help="scrape the engines' /metrics (running, waiting, KV usage) every "
                        f"{d.load_scrape.interval_s:g} s as load reports, so that several routers see the whole load "
                        "(default: off)")
    p.add_argument("--broker", metavar="NATS_URL",
                   help="share in-flight load (and, in approximate mode, routing decisions) with the other routers "
                        "on this NATS broker, e.g. nats://10.0.0.5:4222; needs pdlb[broker]; more settings in the config "
                        "file's broker: section (default: none)")
    p.add_argument("--pd-min-uncached-tokens", type=int, metavar="TOKENS",
                   help="conditional disaggregation: requests with fewer uncached prompt tokens run on the decode "
                        f"engine alone (default: {d.router.pd_min_uncached_tokens}, always prefill + decode)")
    p.add_argument("--request-timeout-s", type=float, metavar="SECONDS",
                   help=f"per client request, retries included; 504 after (default: {d.request_timeout_s:g})")
    p.add_argument("--stream-first-chunk-timeout-s", type=float, metavar="SECONDS",
                   help="without --first-byte-timeout-s, still fail and retry elsewhere a streamed decode leg whose "
                        f"headers and first chunk do not come within this; 0 turns it off (default: "
                        f"{d.stream_first_chunk_timeout_s:g})")
    p.add_argument("--first-byte-timeout-s", type=float, metavar="SECONDS",
                   help="per leg: fail and retry elsewhere when a worker sends no headers / first chunk within this "
                        "(default: off)")
    p.add_argument("--upstream-client", choices=["lean", "aiohttp"],
                   help="HTTP client of the legs to the engines: lean (keep-alive pool parsed by httptools) or aiohttp "
                        f"(aiohttp's client, the fallback) (default: {d.upstream_client})")
    p.add_argument("--http-front", choices=["aiohttp", "lean"],
                   help="HTTP server of the generation endpoints: aiohttp's, or lean (httptools for the common "
                        f"generation request, aiohttp's server for anything else) (default: {d.http_front})")
    p.add_argument("--connection-placement", choices=["follow_load", "round_robin"],
                   help="with --processes > 1: place client connections on as few processes as the load needs "
                        "(follow_load: the others give theirs back with Connection: close) or on every process in "
                        f"turn (round_robin) (default: {d.connection_placement}; follow_load needs the lean "
                        "--http-front: with aiohttp's the processes get connections round robin, and serve says so)")
    p.add_argument("--placement-target-util", type=float, metavar="CORES",
                   help="with --connection-placement follow_load: cores per active router process the active set is "
                        "sized for, 0.3-0.95 (higher: fewer, busier processes; 0.9 measured no better than the "
                        f"default, docs/serving.md) (default: {d.placement_target_util:g})")
    p.add_argument("--placement-even-out", action=argparse.BooleanOptionalAction, default=None,
                   help="with --connection-placement follow_load: also even out the active processes' client "
                        "connections (the fullest gives half the gap back with Connection: close; not measured on a "
                        f"host where it acts, docs/serving.md) (default: {'on' if d.placement_even_out else 'off'})")
    p.add_argument("--pin-processes", action=argparse.BooleanOptionalAction, default=None,
                   help="with --processes > 1: run router process i on one CPU only, the i-th (wrapping) of the CPUs "
                        "pdlb serve may use (Linux; the parent keeps them all) (default: "
                        f"{'on' if d.pin_processes else 'off'}: any CPU of the set)")
    p.add_argument("--prefill-timeout-s", type=float, metavar="SECONDS",
                   help="per attempt: fail and retry elsewhere when a prefill leg has not answered within this; "
                        f"0 turns it off (default: {d.prefill_timeout_s:g})")
    p.add_argument("--max-model-len", type=int, metavar="TOKENS",
                   help="refuse (400) requests whose prompt plus output limit exceed this (default: no limit)")
    p.add_argument("--max-retries", type=int, metavar="N",
                   help="retries of a request that failed before any byte reached the client, each on a new "
                        f"prefill/decode pair (default: {d.retry.max_retries})")
    p.add_argument("--health-check-interval-s", type=float, metavar="SECONDS",
                   help=f"seconds between active health checks of each worker (default: {d.health_check.interval_s:g})")
    p.add_argument("--served-model-name", metavar="NAME",
                   help="model id clients use: /v1/models lists it, and a request naming it reaches each engine under "
                        "the engine's own name (a worker's model=NAME, else the first name its /v1/models lists) "
                        "and is answered under NAME, as is one naming no model (absent, null or \"\") "
                        "(default: none: /v1/models asks the workers, names pass through)")
    p.add_argument("--admin-api-key", help="admin API bearer token (default: $PDLB_ADMIN_API_KEY; none = loopback only; "
                                           "required with a non-loopback --host, and behind a reverse proxy)")
    p.add_argument("--allow-unauthenticated-admin", action="store_true", default=None,
                   help="allow a non-loopback --host without an admin API key (the admin API then answers loopback "
                        "peers only, which a reverse proxy on this host makes every client) (default: refuse)")
    p.add_argument("--processes", type=int, metavar="N",
                   help="router processes behind the port (client connections placed on them by --connection-placement); they share in-flight load (shared "
                        "memory), their routed prompts (approximate mode) or, with workers' events=, the engines' KV "
                        "events; admin API changes reach all of them (default: one per core this process may run "
                        f"on, {default_processes()} here; with a worker on this host one per "
                        f"{LOCAL_ENGINE_CORE_SHARE} cores, {default_processes(['http://127.0.0.1'])} here, leaving "
                        "the rest to the engines). Round robin counts per process")
    p.add_argument("--max-process-restarts", type=int, metavar="N",
                   help="--processes N > 1: restarts of one dead router process allowed within --restart-window-s; "
                        "one more death stops pdlb serve with status 1 (crash loop) (default: 5)")
    p.add_argument("--restart-window-s", type=float, metavar="SECONDS",
                   help="the crash-loop window of --max-process-restarts (default: 60)")
    p.add_argument("--event-loop", choices=["auto", "asyncio", "uvloop"], default="auto",
                   help="event loop: auto = uvloop where installed (it is in the serve extra), else asyncio's "
                        "(default: %(default)s)")
    p.add_argument("--log-level", type=str.upper, choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                   default="WARNING", help="log level of the router's own messages on stderr (default: %(default)s)")
    add_admission_args(p, serve=True)
    return p


def read_cost_model_file(path: str) -> dict:
    """The table of a ``--cost-model`` file: JSON when it ends in ``.json``, else TOML (what
    ``pdlb sim cost-model`` writes); a ``[cost_model]`` table or the bare table. Raises
    ValueError naming the file."""
    p = Path(path)
    kind = "JSON" if p.suffix.lower() == ".json" else "TOML"
    try:
        text = p.read_text()
        data = json.loads(text) if kind == "JSON" else tomllib.loads(text)
    except OSError as e:
        raise ValueError(f"--cost-model {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise ValueError(f"--cost-model {path}: not valid {kind} ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"--cost-model {path}: expected a table")
    data = data.get("cost_model", data)
    try:
        CostModel.from_dict(data)
    except ValueError as e:
        raise ValueError(f"--cost-model {path}: {e}") from None
    return data


def config_from_args(args: argparse.Namespace) -> ServiceConfig:
    """Merge ``--config`` with the flags (flags win; workers of both are kept).

    Raises:
        ValueError: one line: a bad config file (``"<file>: <field>: <problem>"``), a bad worker
            spec (``"worker spec '<spec>': <problem>"``) or a bad flag value (``"<field>: <problem>"``,
            problems joined by ``"; "``).
    """
    workers = [parse_worker_spec(text, role) for role in ("prefill", "decode", "mixed")
               for text in getattr(args, role)]
    file_cfg = load_service_config(args.config) if args.config else None
    # the file's own keys only (review5 U2): a whole dump made every field count as given (model_fields_set),
    # so the "changes nothing here" warnings named options neither the file nor a flag gave
    data = file_cfg.model_dump(exclude_unset=True) if file_cfg is not None else {}
    over: dict = {"host": args.host, "port": args.port, "pd_protocol": args.pd_protocol,
                  "block_size": args.block_size, "tokenizer_path": args.tokenizer_path, "chat_engine": args.chat_engine,
                  "pd_min_uncached_tokens": args.pd_min_uncached_tokens, "request_timeout_s": args.request_timeout_s,
                  "first_byte_timeout_s": args.first_byte_timeout_s, "max_model_len": args.max_model_len,
                  "prefill_timeout_s": args.prefill_timeout_s,
                  "allow_unauthenticated_admin": args.allow_unauthenticated_admin,
                  "served_model_name": args.served_model_name, "processes": args.processes,
                  "admin_api_key": args.admin_api_key or os.environ.get("PDLB_ADMIN_API_KEY"),
                  "index_mode": getattr(args, "index_mode", None),
                  "upstream_client": getattr(args, "upstream_client", None),
                  "http_front": getattr(args, "http_front", None),
                  "connection_placement": getattr(args, "connection_placement", None),
                  "pin_processes": getattr(args, "pin_processes", None),
                  "placement_target_util": getattr(args, "placement_target_util", None),
                  "placement_even_out": getattr(args, "placement_even_out", None),
                  "speculative_ttl_s": getattr(args, "speculative_ttl_s", None)}
    data |= {k: v for k, v in over.items() if v is not None}
    off = []  # "0 turns it off": applied after loading (load_service_config ignores None overrides)
    if getattr(args, "stream_first_chunk_timeout_s", None) is not None:
        if args.stream_first_chunk_timeout_s == 0:
            off.append("stream_first_chunk_timeout_s")
        else:
            data["stream_first_chunk_timeout_s"] = args.stream_first_chunk_timeout_s
    if args.prefill_timeout_s == 0:
        data.pop("prefill_timeout_s", None)
        off.append("prefill_timeout_s")
    if args.prefill_policy:
        data["prefill_policy"] = args.prefill_policy  # "name" or "name:k=v,..." (balancer.policies.spec)
    if args.decode_policy:
        data["decode_policy"] = args.decode_policy
    if getattr(args, "cost_model", None):
        data["cost_model"] = read_cost_model_file(args.cost_model)
    if getattr(args, "no_learn_cost_model", False):
        data["learn_cost_model"] = False
    data, _ = move_legacy_router_keys(data, override=True)  # the router flags above go to the router: section
    data["workers"] = data.get("workers", []) + workers
    if args.max_retries is not None:
        data.setdefault("retry", {})["max_retries"] = args.max_retries
    if getattr(args, "scrape_load", None):
        data.setdefault("load_scrape", {})["enabled"] = True
    if getattr(args, "broker", None):
        data.setdefault("broker", {})["url"] = args.broker
    if args.health_check_interval_s is not None:
        data.setdefault("health_check", {})["interval_s"] = args.health_check_interval_s
    if adm := admission_overrides(args):
        data.setdefault("admission", {}).update(adm)
    cfg = load_service_config(None, data)
    if adm and not cfg.admission.enabled:  # tuning flags without --admission (or admission.enabled in the file)
        raise ValueError(f"{flag_names(adm)} need --admission (or admission: enabled: true in the config file)")
    cfg = cfg.model_copy(update={k: None for k in off}) if off else cfg
    if file_cfg is not None:  # the file's deprecated top-level router keys, for config_warnings
        cfg._legacy_router_keys = file_cfg._legacy_router_keys
    return cfg


def ignored_budget_warning(cfg: ServiceConfig) -> str | None:
    """The warning for a TTFT budget ``pdlb serve`` would be given and never use (review R4): the
    policy of the pool the budget acts on (prefill with prefill workers, else the mixed pool's)
    is ep_aware with a budget (its own ``ttft_slo_s``, or the router's ``ttft_slo``) and
    ``slo_wide_ep`` off, and the cost model says every engine of that pool is wide EP
    (``ep_synchronous``): ep_aware then routes SLO-blind. ``None``: nothing to say."""
    rc = cfg.router
    pd = any(w.role == "prefill" for w in cfg.workers)
    spec = rc.prefill_policy if pd else rc.decode_policy
    policy = spec.build()
    if policy.name != "ep_aware" or policy.slo_wide_ep:
        return None
    if not (policy.ttft_slo_s > 0 or (rc.ttft_slo is not None and policy.slo_aware)):
        return None
    role = "prefill" if pd else "mixed"
    urls = [w.url for w in cfg.workers if w.role == role]
    model = rc.cost_model if rc.cost_model is not None else DEFAULT_COST_MODEL
    if not urls or not all(model.engine(u, role).ep_synchronous for u in urls):
        return None
    return (f"the {role} policy {spec.name} has a TTFT budget it will not use: every {role} engine is wide EP "
            "(ep_synchronous in the cost model), where ep_aware routes SLO-blind unless slo_wide_ep=true")


def check_restart_flags(args: argparse.Namespace) -> None:
    """``--max-process-restarts`` >= 0 and ``--restart-window-s`` > 0 (``inf``: deaths are never
    forgotten), checked before anything starts whatever the process count (the supervisor,
    :class:`balancer.service.processes.supervise.RestartPolicy`, runs only with several).

    Raises:
        ValueError: naming the flag."""
    n = getattr(args, "max_process_restarts", None)
    if n is not None and n < 0:
        raise ValueError(f"--max-process-restarts: expected an integer >= 0 (0: a dead router process is not "
                         f"restarted), got {n}")
    w = getattr(args, "restart_window_s", None)
    if w is not None and not w > 0:  # NaN too
        raise ValueError(f"--restart-window-s: expected a number of seconds > 0, got {w:g}")


def idle_process_option_warnings(cfg: ServiceConfig) -> list[str]:
    """Warnings for process options given (flag or config key) where they change nothing (review3
    S1, session 16): ``pin_processes`` with one router process (it pins each of several), and
    ``placement_target_util`` (given) and ``placement_even_out`` (on) where connections are not placed
    by load: one process, ``connection_placement: round_robin``, or ``http_front: aiohttp`` (placed
    round robin then).
    ``cfg.processes`` ``None`` counts as :func:`default_processes` for the workers. Empty: nothing to say."""
    n = cfg.processes if cfg.processes is not None else default_processes(w.url for w in cfg.workers)
    given = cfg.model_fields_set
    out = []
    if cfg.pin_processes and n == 1:
        out.append("--pin-processes changes nothing here: one router process (it pins each of several to its own "
                   "CPU; --processes N)")
    why = ("there is one router process (--processes N)" if n == 1 else
           "connections are placed round robin (--connection-placement round_robin)"
           if cfg.connection_placement == "round_robin" else
           "connections are placed round robin (--http-front aiohttp)" if cfg.http_front == "aiohttp" else None)
    if why is not None and "placement_target_util" in given:
        out.append(f"--placement-target-util changes nothing here: it sizes the load-following placement's "
                   f"active processes, and {why}")
    if why is not None and cfg.placement_even_out:  # review5 U1: the even-out pass is the same placement's
        out.append(f"--placement-even-out changes nothing here: it evens out the load-following placement's "
                   f"active processes, and {why}")
    return out


def idle_policy_option_warnings(cfg: ServiceConfig) -> list[str]:
    """Warnings for ``ep_aware`` options of the decode (or mixed) pool's policy that need engine data
    the cost model does not have, so that they change no decision (review F9): ``spec_decode`` where
    no engine of the pool has ``decode_tokens_per_step`` above 1 (the policy's tau is then 1), and
    ``seq_cap`` where none has ``max_num_seqs`` (no cap to price), ``parallel_chunks`` (either
    policy) outside a mixed pool or where no wide-EP engine of it runs its chunks in parallel
    (:func:`balancer.prefill_cadence.chunks_in_parallel`; a dense engine's prompt has no group
    tokens to price, review R3 of session 16), ``prefill_at_once`` (either policy) outside a mixed
    pool or where no engine of it runs its chunks in parallel, ``session_forecast`` on the prefill
    policy of a PD deployment. Empty: nothing to say."""
    rc = cfg.router
    role = "decode" if any(w.role == "decode" for w in cfg.workers) else "mixed"
    urls = [w.url for w in cfg.workers if w.role == role]
    out = []
    prefill = rc.prefill_policy.build()
    for opt in _MIXED_CHUNK_OPTIONS:
        if prefill.name == "ep_aware" and getattr(prefill, opt) and any(w.role == "prefill" for w in cfg.workers):
            out.append(f"the prefill policy ep_aware has {opt}=true, which changes nothing here: it prices "
                       "mixed pools only (prefill pools the same either way)")
    if prefill.name == "ep_aware" and prefill.session_forecast and any(w.role == "prefill" for w in cfg.workers):
        out.append("the prefill policy ep_aware has session_forecast=true, which changes nothing here: it prices "
                   "decode and mixed pools only (prefill pools the same either way)")
    policy = rc.decode_policy.build()
    if policy.name != "ep_aware" or not urls:
        return out
    model = rc.cost_model if rc.cost_model is not None else DEFAULT_COST_MODEL
    engines = [model.engine(u, role) for u in urls]
    if policy.spec_decode and all(e.decode_tokens_per_step <= 1.0 for e in engines):
        out.append(f"the decode policy ep_aware has spec_decode=true, which changes nothing here: no {role} engine has "
                   "decode_tokens_per_step above 1 in the cost model (give --cost-model a file with it: pdlb sim "
                   "cost-model writes it for a [speculative] table with verify = \"every_step\")")
    if policy.seq_cap and all(e.max_num_seqs is None for e in engines):
        out.append(f"the decode policy ep_aware has seq_cap=true, which changes nothing here: no {role} engine has "
                   "max_num_seqs in the cost model (give --cost-model a file with it: pdlb sim cost-model writes the "
                   "pool's)")
    for option in _MIXED_CHUNK_OPTIONS:
        if not getattr(policy, option):
            continue
        idle = f"the decode policy ep_aware has {option}=true, which changes nothing here: "
        if role != "mixed":
            out.append(idle + "it prices mixed pools only (decode pools the same either way)")
        elif not (policy.cadence and any(chunks_in_parallel(e.max_num_seqs, e.request_chunk_tokens, e.chunk_tokens)
                                         for e in engines)):
            out.append(idle + "no mixed engine has max_num_seqs and request_chunk_tokens with max_num_seqs x "
                       "request_chunk_tokens <= chunk_tokens in the cost model, or cadence=false (give --cost-model a "
                       "file with them: pdlb sim cost-model writes the pool's)")
        elif option == "parallel_chunks" and not any(
                e.ep_synchronous and chunks_in_parallel(e.max_num_seqs, e.request_chunk_tokens, e.chunk_tokens)
                for e in engines):  # a dense engine's prompt has no group tokens: both models' group terms are 0
            out.append(idle + "the mixed engines whose chunks run in parallel are dense (ep_synchronous = false in "
                       "the cost model), so a prompt has no group tokens to price either way")
    return out


#: ``ep_aware`` options that price only mixed pools whose engines run a prompt's chunks in parallel
_MIXED_CHUNK_OPTIONS = ("parallel_chunks", "prefill_at_once")


def run_serve(args: argparse.Namespace) -> int:
    """Run ``pdlb serve`` until SIGINT/SIGTERM; returns the exit status (2 after one ``error:`` line
    on stderr for a bad flag or config file)."""
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        check_restart_flags(args)
        cfg = config_from_args(args)
        event_loop_factory(args.event_loop)  # uvloop asked for but not installed: before anything starts
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ignored = ignored_budget_warning(cfg)
    if ignored is not None:
        print(f"warning: {ignored}", file=sys.stderr)
    for line in idle_policy_option_warnings(cfg):
        print(f"warning: {line}", file=sys.stderr)
    for line in idle_process_option_warnings(cfg):
        print(f"warning: {line}", file=sys.stderr)
    return serve(cfg, event_loop=args.event_loop, log_level=args.log_level,
                 max_process_restarts=getattr(args, "max_process_restarts", None),
                 restart_window_s=getattr(args, "restart_window_s", None))


class Serve:
    """``pdlb serve`` (:class:`pdlb_cli.command.Subcommand`)."""

    name = "serve"
    add_parser = staticmethod(add_serve_parser)

    def run(self, args: argparse.Namespace, console: Console) -> int:
        return run_serve(args)


def main(argv: list[str] | None = None) -> int:
    """``pdlb-serve ARGS``: ``pdlb serve`` for an install with only the ``serve`` extra
    (``pip install 'pdlb[serve]'``; the ``pdlb`` command also needs the simulator's ``sim`` extra)."""
    parser = argparse.ArgumentParser(prog="pdlb-serve", description="the pdlb router service (pdlb serve)")
    sub = parser.add_subparsers(dest="command")
    add_serve_parser(sub).prog = "pdlb-serve"
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    try:
        kernels.use_compiled(kernels.enabled_by_env(os.environ))  # PDLB_KERNELS
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return run_serve(args)
