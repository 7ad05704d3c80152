"""The figure no anchor publishes: prefix hit rate, TTFT p50/p99 and goodput vs the number of
routers (1, 2, 4, 8), with no sharing, KV events only, and broker sharing (issue 28 item 2).

Run by hand::

    .venv/bin/python bench/k_routers_figure.py --out /tmp/k_routers            # simulator: table + plot (~5 min)
    .venv/bin/python bench/k_routers_figure.py --live --no-sim --out /tmp/kr   # loopback check, 2 routers (~2 min)

**Simulator** (:mod:`sim.experiments.broker_routers`): the embedded Mooncake trace on
``dsv3-pd-h200`` (cache_aware prefill, least_load decode), K routers splitting the requests
round-robin; modes ``approximate`` (nothing shared), ``events`` (every router consumes every
engine's KV events, own load), ``approximate+broker`` / ``events+broker`` (``pdlb serve
--broker``'s sharing: load snapshots every 50 ms delivered 1 ms later, decisions batched the same
way) and ``events+shared-load`` (one instant load view, the zero-delay bound). Ratios are to
K = 1 of the same mode, measured in the same run. Writes ``summary.json``, ``table.md`` and
``k_routers.png``.

**Live** (``--live``): a real ``nats-server`` and emulated mixed engines on loopback; a multi-turn
workload (sessions sharing a system prompt, each turn extending its session's prompt; by default
48 sessions of 2 turns, so that the second turn reaches a router that did not route the first)
whose turns alternate between two ``pdlb serve`` routers (approximate mode, cache_aware), once without a
broker and once with ``--broker``, plus one router alone as the baseline. Each configuration gets
fresh engines. Prefix hit rate is the engines' own count (``usage.prompt_tokens_details.cached_tokens``
over prompt tokens), TTFT the client's (first streamed token), goodput the requests per second
whose TTFT met ``--ttft-slo-s``. The broker's measured publish-to-receipt time is read from the
routers' ``pdlb_broker_delivery_seconds``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sim.experiments.broker_routers import MODES, markdown, run  # noqa: E402


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(17, 4))
    panels = [("hit_rate", "prefix hit rate", 100.0), ("ttft_p50_s", "TTFT p50 (s)", 1.0),
              ("ttft_p99_s", "TTFT p99 (s)", 1.0), ("goodput_rps", "goodput (req/s)", 1.0)]
    for ax, (key, title, scale) in zip(axes, panels):
        for mode in dict.fromkeys(r["mode"] for r in rows):
            pts = sorted((r["k"], r[key] * scale) for r in rows if r["mode"] == mode)
            ax.plot([k for k, _ in pts], [v for _, v in pts], marker="o", label=mode)
        ax.set_xscale("log", base=2)
        ax.set_xticks([1, 2, 4, 8], ["1", "2", "4", "8"])
        ax.set_xlabel("routers (K)")
        ax.set_title(title + (" %" if key == "hit_rate" else ""))
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("K routers splitting the Mooncake trace (dsv3-pd-h200, simulator); broker: 50 ms interval + 1 ms")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ---------------------------------------------------------------------- live
def _sessions(n_sessions: int, turns: int) -> list[list[str]]:
    system = "You are a careful assistant for the ACME support desk. " * 60  # ~800 tokens at 4 chars/token
    out = []
    for s in range(n_sessions):
        ctx = system + f"Session {s} customer file: " + f"record {s} line item detail " * 400  # ~2,900 tokens of its own
        prompts = []
        for t in range(turns):
            ctx += f" Question {t} of session {s}: what about item {t * 7 + s}? " * 4
            prompts.append(ctx)
        out.append(prompts)
    return out


async def _drive(routers: list[Any], n_sessions: int, turns: int, max_tokens: int) -> list[dict[str, float]]:
    import aiohttp

    results: list[dict[str, float]] = []

    async def session(s: aiohttp.ClientSession, sid: int, prompts: list[str]) -> None:
        for t, prompt in enumerate(prompts):
            router = routers[(sid + t) % len(routers)]  # consecutive turns alternate routers
            body = {"model": "emu", "prompt": prompt, "max_tokens": max_tokens, "stream": True}
            t0 = time.monotonic()
            ttft = None
            usage: dict[str, Any] = {}
            async with s.post(router.url + "/v1/completions", json=body) as r:
                if r.status != 200:
                    results.append({"status": r.status})
                    continue
                async for line in r.content:
                    if not line.startswith(b"data: {"):
                        continue
                    ev = json.loads(line[6:])
                    if ttft is None and ev.get("choices") and ev["choices"][0].get("text"):
                        ttft = time.monotonic() - t0
                    if ev.get("usage"):
                        usage = ev["usage"]
            results.append({"status": 200, "ttft_s": ttft if ttft is not None else float("nan"),
                            "prompt_tokens": usage.get("prompt_tokens", 0),
                            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)})

    async with aiohttp.ClientSession() as s:
        await asyncio.gather(*[session(s, i, p) for i, p in enumerate(_sessions(n_sessions, turns))])
    return results


async def _delivery(router: Any) -> tuple[float, float]:
    import aiohttp

    async with aiohttp.ClientSession() as s, s.get(router.url + "/metrics") as r:
        text = await r.text()
    vals = {m.group(1): float(m.group(2)) for m in
            re.finditer(r"^pdlb_broker_delivery_seconds_(sum|count)\{[^}]*\} ([0-9.e+-]+)$", text, re.M)}
    return vals.get("sum", 0.0), vals.get("count", 0.0)


def live(args: argparse.Namespace) -> list[dict[str, Any]]:
    from sim.emulator.nats_broker import NatsServer
    from sim.emulator.testing import spawn_engines, spawn_router

    import numpy as np

    engine_args = ("--model", "llama-3.1-8b", "--speed", str(args.speed))
    policy = ("--decode-policy", "cache_aware", "--index-mode", "approximate", "--served-model-name", "emu")
    rows = []
    with NatsServer() as nats:
        for label, n_routers, broker in (("1 router", 1, False), ("2 routers, nothing shared", 2, False),
                                         ("2 routers, broker", 2, True)):
            engines = spawn_engines([("mixed", *engine_args)] * args.engines)
            routers = []
            try:
                extra = ("--broker", nats.url) if broker else ()
                for _ in range(n_routers):
                    routers.append(spawn_router("none", [], [], *policy, *extra, mixed=engines))
                if broker:
                    time.sleep(2.0)  # both connected and heard each other (heartbeat 1 s)
                t0 = time.monotonic()
                res = asyncio.run(_drive(routers, args.sessions, args.turns, args.max_tokens))
                wall = time.monotonic() - t0
                delivery = [asyncio.run(_delivery(r)) for r in routers] if broker else []
            finally:
                for p in routers + engines:
                    p.stop()
            ok = [r for r in res if r["status"] == 200]
            ttft = np.array([r["ttft_s"] for r in ok])
            row = {"config": label, "requests": len(res), "errors": len(res) - len(ok),
                   "hit_rate": sum(r["cached_tokens"] for r in ok) / max(1, sum(r["prompt_tokens"] for r in ok)),
                   "ttft_p50_s": float(np.nanpercentile(ttft, 50)), "ttft_p99_s": float(np.nanpercentile(ttft, 99)),
                   "goodput_rps": float(np.sum(ttft <= args.ttft_slo_s)) / wall, "wall_s": wall}
            if delivery:
                total, count = sum(d[0] for d in delivery), sum(d[1] for d in delivery)
                row["broker_delivery_mean_ms"] = 1000 * total / count if count else float("nan")
                row["broker_messages"] = count
            rows.append(row)
            print(f"  live {label}: hit {100 * row['hit_rate']:.1f}%  TTFT p50 {row['ttft_p50_s']:.3f} s  "
                  f"p99 {row['ttft_p99_s']:.3f} s  goodput {row['goodput_rps']:.2f} r/s", file=sys.stderr, flush=True)
    return rows


async def _staleness(n: int, interval_s: float) -> dict[str, float]:
    """Two routers' broker sides on a real nats-server: time from a dispatch on A until B's tracker
    counts it, ``n`` times (the wall clock; one event loop drives both, as two hosts' loops would)."""
    import numpy as np

    from balancer.parts import LoadSources
    from balancer.router import Router
    from balancer.service.broker_config import BrokerConfig
    from balancer.service.broker_sync import BrokerSync
    from balancer.types import ReplicaId
    from sim.emulator.nats_broker import NatsServer

    rep = ReplicaId("http://m0")
    with NatsServer() as nats:
        cfg = BrokerConfig(url=nats.url, publish_interval_s=interval_s)
        a, b = (BrokerSync(cfg, g, replicas=lambda: [rep]) for g in "AB")
        routers = [Router("least_load", "least_load", load_sources=LoadSources(peer=sync)) for sync in (a, b)]
        for r in routers:
            r.add_replica(rep, "mixed")
        a.start(routers[0].record_routed)
        b.start(routers[1].record_routed)
        try:
            while not (a.table.peers and b.table.peers):
                await asyncio.sleep(0.01)
            lags = []
            for i in range(n):
                await asyncio.sleep(interval_s * ((i * 0.618) % 1.0))  # dispatches at varied phases
                routers[0].load.on_dispatch(f"r{i}", None, rep, 1, 1)
                a.publish()
                t0 = time.monotonic()
                while True:
                    b.refresh()
                    if routers[1].load.peer_requests[0] == i + 1:
                        break
                    await asyncio.sleep(0.0005)
                lags.append(time.monotonic() - t0)
            deliveries = b.delivery_sum_s / max(1, sum(b.delivery_counts))
        finally:
            await a.close()
            await b.close()
    x = np.array(lags)
    return {"n": n, "interval_s": interval_s, "p50_s": float(np.percentile(x, 50)), "p99_s": float(np.percentile(x, 99)),
            "max_s": float(x.max()), "delivery_mean_s": deliveries}


def live_markdown(rows: list[dict[str, Any]]) -> str:
    base = rows[0]
    out = ["| live, loopback | requests (errors) | engine prefix hit rate | TTFT p50 s | TTFT p99 s | goodput r/s "
           "| TTFT p50 vs 1 router | broker delivery mean |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        d = r.get("broker_delivery_mean_ms")
        out.append(f"| {r['config']} | {r['requests']} ({r['errors']}) | {100 * r['hit_rate']:.1f}% | "
                   f"{r['ttft_p50_s']:.3f} | {r['ttft_p99_s']:.3f} | {r['goodput_rps']:.2f} | "
                   f"x{r['ttft_p50_s'] / base['ttft_p50_s']:.2f} | {'-' if d is None else f'{d:.2f} ms'} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    from pdlb_cli.args import ArgumentParser  # one usage line, then the error
    from pdlb_cli.arg_types import positive_float, positive_int

    ap = ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ks", default="1,2,4,8", help="router counts (default: %(default)s)")
    ap.add_argument("--modes", default=",".join(MODES), help="simulator modes (default: %(default)s)")
    ap.add_argument("--limit", type=positive_int, default=None, help="first N trace requests (default: all)")
    ap.add_argument("--no-sim", action="store_true", help="skip the simulator part")
    ap.add_argument("--live", action="store_true", help="also run the loopback check (2 routers)")
    ap.add_argument("--engines", type=positive_int, default=2, help="live: emulated mixed engines (default: %(default)s)")
    ap.add_argument("--sessions", type=positive_int, default=48, help="live: concurrent sessions (default: %(default)s)")
    ap.add_argument("--turns", type=positive_int, default=2, help="live: turns per session (default: %(default)s)")
    ap.add_argument("--max-tokens", type=positive_int, default=16, help="live: output tokens per turn (default: %(default)s)")
    ap.add_argument("--speed", type=positive_float, default=1.0, help="live: engine speed factor (default: %(default)s)")
    ap.add_argument("--ttft-slo-s", type=positive_float, default=0.5, help="live: TTFT SLO for goodput (default: %(default)s)")
    ap.add_argument("--staleness-samples", type=positive_int, default=200,
                    help="live: dispatches timed from router A to router B (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=None, help="write results here (default: print only)")
    args = ap.parse_args(argv)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    if not args.no_sim:
        from pdlb_cli.args import positive_int
        from pdlb_cli.comma_lists import list_arg, one_of

        rows = run(list_arg(ap, "--ks", args.ks, "router counts >= 1", positive_int),
                   list_arg(ap, "--modes", args.modes, f"modes of {', '.join(MODES)}", one_of(MODES)), args.limit,
                   log=lambda s: print(s, file=sys.stderr, flush=True))
        md = markdown(rows)
        print(md)
        if args.out is not None:
            (args.out / "summary.json").write_text(json.dumps(rows, indent=2))
            (args.out / "table.md").write_text(md + "\n")
            plot(rows, args.out / "k_routers.png")
    if args.live:
        st = asyncio.run(_staleness(args.staleness_samples, 0.05))
        print(f"broker staleness on loopback ({st['n']} dispatches, publish interval {st['interval_s']:g} s): "
              f"p50 {1000 * st['p50_s']:.1f} ms, p99 {1000 * st['p99_s']:.1f} ms, max {1000 * st['max_s']:.1f} ms "
              f"(x{st['p99_s'] / st['interval_s']:.2f} the interval at p99); delivery mean "
              f"{1000 * st['delivery_mean_s']:.2f} ms")
        if args.out is not None:
            (args.out / "staleness.json").write_text(json.dumps(st, indent=2))
        rows_live = live(args)
        md = live_markdown(rows_live)
        print(md)
        if args.out is not None:
            (args.out / "live.json").write_text(json.dumps(rows_live, indent=2))
            (args.out / "live.md").write_text(md + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
