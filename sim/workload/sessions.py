"""Session workloads: multi-turn chatbot conversations and agent sessions over days.

A *session* is one conversation (chatbot) or one agent task (agent). Its context grows: turn
``k``'s prompt is turn ``k-1``'s prompt, plus turn ``k-1``'s output, plus a new message (a user
message for a chatbot, a tool result for an agent). So a later prompt extends the earlier one and
its block hashes start with all of the earlier prompt's full-block hashes: exactly the reuse a KV
store with TTL serves (DeepSeek keeps such KV on 3FS SSD for days).

Time structure of one session (all times in seconds; see :class:`SessionClassConfig`):

* sessions start as a Poisson process of rate ``sessions_per_hour`` over ``[0, duration_s)``;
  a fraction ``agent_fraction`` of them are agent sessions, the rest chatbot sessions;
* a session is a chain of *visits*: a visit has ``Geometric(mean = turns_per_visit_mean)`` turns,
  separated by a lognormal *think time* (arrival to arrival, so it includes reading the reply,
  or running the tool);
* after a visit the session returns with probability ``return_probability`` after a heavy-tailed
  *return gap* (lognormal or Pareto, hours to days), and continues the same context;
* a session ends when it does not return, when its next prompt would exceed
  ``max_context_tokens``, or at ``duration_s`` (requests at or after it are not generated).

Agent sessions start with a long system prompt shared by every session of the same agent
(``num_system_prompts`` agents, Zipf popularity), and make many short calls in quick succession.

Block hashes are real chained hashes (:func:`balancer.hashing.hash_token_blocks`) of synthetic
token ids drawn from a seeded numpy RNG; each session hashes its context incrementally (only the
new tokens, chained from its last full block), so memory is O(blocks), not O(tokens), and a week
of traffic generates in seconds. Only full blocks are hashed (``len(block_hashes) ==
prompt_tokens // block_size``), as in vLLM's prefix caching.

Time compression: arrivals are just timestamps, so a 7-day workload is cheap to simulate: the
discrete-event simulator jumps from one event to the next and nothing happens in idle gaps except
TTL expiry, which a store evaluates lazily at the next access. Arrival times are rounded to whole
milliseconds, so they survive a round trip through the Mooncake JSONL format exactly.

Determinism: the result is a pure function of the config. Session ``j`` draws from its own RNG
(``SeedSequence([seed, 2, j])``) and agent ``k``'s system prompt from ``SeedSequence([seed, 1,
k])``, so sessions do not depend on each other's draws.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from balancer.hashing import hash_token_blocks, leading_held
from balancer.types import Request

__all__ = [
    "AGENT",
    "CHATBOT",
    "SessionClassConfig",
    "SessionWorkloadConfig",
    "session_workload",
    "workload_summary",
]

CHATBOT = "chatbot"
AGENT = "agent"
HOUR_S = 3600.0
DAY_S = 86400.0


class SessionClassConfig(BaseModel):
    """Behaviour of one traffic class's sessions. Lengths in tokens, times in seconds.

    Lengths are ``LogNormal`` with the given mean (of the continuous distribution) and log-space
    sigma, rounded and clipped to >= 1 (as :func:`sim.workload.poisson_workload`).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    turns_per_visit_mean: float = Field(3.0, ge=1.0, description="mean turns (calls) per visit; Geometric on {1, 2, ...}")
    think_time_median_s: float = Field(60.0, gt=0, description="median time between a turn's arrival and the next turn's, s")
    think_time_sigma: float = Field(1.0, ge=0, description="log-space sigma of the think time")
    message_tokens_mean: float = Field(300.0, gt=0, description="mean new user message / tool result per turn, tokens")
    message_tokens_sigma: float = Field(1.0, ge=0)
    output_tokens_mean: float = Field(600.0, gt=0, description="mean output per turn, tokens (appended to the next prompt)")
    output_tokens_sigma: float = Field(0.7, ge=0)
    return_probability: float = Field(0.5, ge=0, le=1, description="probability that a session comes back after a visit")
    return_gap_distribution: Literal["lognormal", "pareto"] = Field(
        "lognormal", description="return gap law: lognormal(median, sigma) or Pareto(median, alpha)")
    return_gap_median_s: float = Field(6 * HOUR_S, gt=0, description="median gap between visits, s")
    return_gap_sigma: float = Field(1.5, ge=0, description="log-space sigma of a lognormal return gap")
    return_gap_pareto_alpha: float = Field(1.0, gt=0, description="tail index of a Pareto return gap (x_m = median / 2**(1/alpha))")
    system_prompt_tokens: int = Field(0, ge=0, description="shared system prompt at the start of every session, tokens")
    num_system_prompts: int = Field(1, ge=1, description="distinct system prompts (agents) sessions pick from")
    system_prompt_zipf_s: float = Field(1.0, ge=0, description="Zipf exponent of system prompt popularity (0 = uniform)")
    max_context_tokens: int = Field(65536, ge=1, description="a session ends when its next prompt would exceed this")


def _chatbot_default() -> SessionClassConfig:
    return SessionClassConfig()


def _agent_default() -> SessionClassConfig:
    return SessionClassConfig(
        turns_per_visit_mean=20.0,
        think_time_median_s=3.0,
        think_time_sigma=0.8,
        message_tokens_mean=800.0,
        message_tokens_sigma=1.2,
        output_tokens_mean=250.0,
        output_tokens_sigma=0.8,
        return_probability=0.2,
        return_gap_median_s=1 * HOUR_S,
        return_gap_sigma=2.0,
        system_prompt_tokens=12000,
        num_system_prompts=20,
        max_context_tokens=131072,
    )


class SessionWorkloadConfig(BaseModel):
    """A session workload: duration, rate, class mix and per-class behaviour. Seeded, frozen.

    The defaults give about 60 sessions per hour (about 12k requests per simulated day).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    duration_s: float = Field(7 * DAY_S, gt=0, description="sessions start in [0, duration_s); requests after it are cut, s")
    sessions_per_hour: float = Field(60.0, gt=0, description="new sessions per hour (Poisson), both classes together")
    agent_fraction: float = Field(0.3, ge=0, le=1, description="fraction of sessions that are agent sessions")
    block_size: int = Field(512, ge=1, description="tokens per KV block for the block hashes")
    vocab_size: int = Field(100_000, ge=2, le=2**32, description="synthetic token ids are uniform in [0, vocab_size)")
    seed: int = Field(0, description="seed of every random draw")
    chatbot: SessionClassConfig = Field(default_factory=_chatbot_default)
    agent: SessionClassConfig = Field(default_factory=_agent_default)

    @field_validator("agent", mode="before")
    @classmethod
    def _agent_partial(cls, v: object) -> object:
        """A partial ``agent`` mapping overrides the agent defaults, not the chatbot ones."""
        if isinstance(v, dict):
            return _agent_default().model_dump() | v
        return v

    @model_validator(mode="after")
    def _check(self) -> SessionWorkloadConfig:
        if self.duration_s * self.sessions_per_hour / HOUR_S > 5e6:
            raise ValueError("more than 5 million sessions: lower duration_s or sessions_per_hour")
        return self

    def class_config(self, traffic_class: str) -> SessionClassConfig:
        """The :class:`SessionClassConfig` of ``"chatbot"`` or ``"agent"``."""
        if traffic_class == CHATBOT:
            return self.chatbot
        if traffic_class == AGENT:
            return self.agent
        raise ValueError(f"unknown traffic class {traffic_class!r}; expected {CHATBOT!r} or {AGENT!r}")


def _lognormal(rng: np.random.Generator, mean: float, sigma: float) -> int:
    """One length: LogNormal with continuous mean ``mean``, rounded, >= 1."""
    if sigma <= 0:
        return max(1, round(mean))
    return max(1, int(round(rng.lognormal(math.log(mean) - 0.5 * sigma * sigma, sigma))))


def _return_gap_s(rng: np.random.Generator, c: SessionClassConfig) -> float:
    if c.return_gap_distribution == "pareto":
        alpha = c.return_gap_pareto_alpha
        x_m = c.return_gap_median_s / 2.0 ** (1.0 / alpha)  # median of Pareto(x_m, alpha) = x_m 2^(1/alpha)
        return x_m * (1.0 - rng.random()) ** (-1.0 / alpha)
    if c.return_gap_sigma <= 0:
        return c.return_gap_median_s
    return float(rng.lognormal(math.log(c.return_gap_median_s), c.return_gap_sigma))


def _think_s(rng: np.random.Generator, c: SessionClassConfig) -> float:
    if c.think_time_sigma <= 0:
        return c.think_time_median_s
    return float(rng.lognormal(math.log(c.think_time_median_s), c.think_time_sigma))


@dataclass
class _Context:
    """A growing token context, kept as its full-block hashes plus the partial tail's tokens."""

    hashes: list[int]
    tail: np.ndarray  # uint32 tokens after the last full block, shape (n_tail < block_size,)
    tokens: int

    def extend(self, new_tokens: np.ndarray, block_size: int) -> None:
        buf = np.concatenate((self.tail, new_tokens)) if self.tail.size else new_tokens
        parent = self.hashes[-1] if self.hashes else None
        self.hashes.extend(hash_token_blocks(buf, block_size, parent_hash=parent))
        self.tail = buf[(buf.size // block_size) * block_size :]
        self.tokens += int(new_tokens.size)

    def copy(self) -> _Context:
        return _Context(list(self.hashes), self.tail, self.tokens)


def _tokens(rng: np.random.Generator, n: int, vocab: int) -> np.ndarray:
    return rng.integers(0, vocab, size=n, dtype=np.uint32)


def session_workload(config: SessionWorkloadConfig | None = None) -> list[Request]:
    """Generate a session workload (see the module docstring for the model).

    Args:
        config: the workload; ``None`` = the defaults (one week, 60 sessions per hour).

    Returns:
        Requests sorted by arrival time (ties: session, then turn), ids ``f"r{i}"`` in that
        order, each with ``session_id = f"s{j}"``, ``traffic_class`` ``"chatbot"`` or
        ``"agent"``, ``prompt_tokens`` = the whole context, ``block_hashes`` = its
        ``prompt_tokens // block_size`` full-block chained hashes, and
        ``expected_output_tokens == max_output_tokens``. Arrival times are whole milliseconds.
    """
    cfg = config or SessionWorkloadConfig()
    bs, vocab, seed = cfg.block_size, cfg.vocab_size, cfg.seed
    master = np.random.default_rng(np.random.SeedSequence([seed, 0]))
    rate_per_s = cfg.sessions_per_hour / HOUR_S
    # Session starts: Poisson process on [0, duration_s), drawn in chunks.
    starts: list[float] = []
    t = 0.0
    while True:
        gaps = master.exponential(1.0 / rate_per_s, size=4096)
        for g in gaps:
            t += float(g)
            if t >= cfg.duration_s:
                break
            starts.append(t)
        else:
            continue
        break
    n_sessions = len(starts)
    is_agent = master.random(n_sessions) < cfg.agent_fraction
    prompt_pick = {cls: _zipf_picks(master, cfg.class_config(cls), n_sessions) for cls in (CHATBOT, AGENT)}

    system_contexts: dict[tuple[str, int], _Context] = {}

    def system_context(cls: str, k: int) -> _Context:
        ctx = system_contexts.get((cls, k))
        if ctx is None:
            n = cfg.class_config(cls).system_prompt_tokens
            rng = np.random.default_rng(np.random.SeedSequence([seed, 1, 0 if cls == CHATBOT else 1, k]))
            ctx = _Context([], np.empty(0, np.uint32), 0)
            ctx.extend(_tokens(rng, n, vocab), bs)
            system_contexts[(cls, k)] = ctx
        return ctx.copy()

    rows: list[tuple[float, int, int, int, tuple[int, ...], int, str]] = []
    for j, t0 in enumerate(starts):
        cls = AGENT if is_agent[j] else CHATBOT
        c = cfg.class_config(cls)
        rng = np.random.default_rng(np.random.SeedSequence([seed, 2, j]))
        if c.system_prompt_tokens > 0:
            ctx = system_context(cls, int(prompt_pick[cls][j]))
        else:
            ctx = _Context([], np.empty(0, np.uint32), 0)
        p_turn_end = 1.0 / c.turns_per_visit_mean
        t = t0
        turn = 0
        done = False
        while not done:
            n_turns = int(rng.geometric(p_turn_end))
            for i in range(n_turns):
                if i > 0:
                    t += _think_s(rng, c)
                t_ms = round(t * 1000.0)
                if t_ms >= cfg.duration_s * 1000.0:
                    done = True
                    break
                n_msg = _lognormal(rng, c.message_tokens_mean, c.message_tokens_sigma)
                n_out = _lognormal(rng, c.output_tokens_mean, c.output_tokens_sigma)
                if ctx.tokens + n_msg > c.max_context_tokens:
                    done = True
                    break
                ctx.extend(_tokens(rng, n_msg, vocab), bs)
                rows.append((t_ms / 1000.0, j, turn, ctx.tokens, tuple(ctx.hashes), n_out, cls))
                ctx.extend(_tokens(rng, n_out, vocab), bs)
                turn += 1
            if done or rng.random() >= c.return_probability:
                break
            t += _return_gap_s(rng, c)
    rows.sort(key=lambda r: (r[0], r[1], r[2]))
    return [
        Request(
            request_id=f"r{i}",
            arrival_time_s=ts,
            prompt_tokens=n_in,
            block_hashes=hashes,
            max_output_tokens=n_out,
            expected_output_tokens=n_out,
            session_id=f"s{j}",
            traffic_class=cls,
        )
        for i, (ts, j, _, n_in, hashes, n_out, cls) in enumerate(rows)
    ]


def _zipf_picks(rng: np.random.Generator, c: SessionClassConfig, n: int) -> np.ndarray:
    """System prompt index per session, ``P(k) ~ 1 / (k + 1)**s`` over ``num_system_prompts``."""
    k = c.num_system_prompts
    if k == 1:
        return np.zeros(n, dtype=np.int64)
    w = 1.0 / np.arange(1, k + 1, dtype=float) ** c.system_prompt_zipf_s
    return rng.choice(k, size=n, p=w / w.sum())


def workload_summary(requests: Sequence[Request], block_size: int) -> dict[str, dict[str, float]]:
    """Per traffic class (and ``"all"``): requests, sessions, prompt and output tokens, span and
    the ideal (infinite, never-expiring, shared) store's token-weighted prefix hit rate.

    The ideal hit rate of a class counts hits on blocks first stored by any class (an agent's
    system prompt reused by another agent session counts as a hit).
    """
    seen: set[int] = set()
    acc: dict[str, dict[str, float]] = {}
    sessions: dict[str, set[str]] = {}
    for r in sorted(requests, key=lambda r: r.arrival_time_s):
        k = leading_held(r.block_hashes, seen)
        seen.update(r.block_hashes)
        for cls in ("all", r.traffic_class or "none"):
            a = acc.setdefault(cls, {"requests": 0, "prompt_tokens": 0, "output_tokens": 0, "hit_tokens": 0})
            a["requests"] += 1
            a["prompt_tokens"] += r.prompt_tokens
            a["output_tokens"] += r.output_tokens
            a["hit_tokens"] += min(k * block_size, r.prompt_tokens)
            sessions.setdefault(cls, set()).add(r.session_id or r.request_id)
    out: dict[str, dict[str, float]] = {}
    for cls, a in acc.items():
        out[cls] = {
            "requests": a["requests"],
            "sessions": len(sessions[cls]),
            "prompt_tokens": a["prompt_tokens"],
            "output_tokens": a["output_tokens"],
            "ideal_hit_rate": a["hit_tokens"] / a["prompt_tokens"] if a["prompt_tokens"] else 0.0,
        }
    if requests:
        out["all"]["span_s"] = max(r.arrival_time_s for r in requests) - min(r.arrival_time_s for r in requests)
    return out


def load_session_config(path: str | os.PathLike[str]) -> SessionWorkloadConfig:
    """Read a :class:`SessionWorkloadConfig` from a ``.json``, ``.toml`` or ``.yaml`` file.

    Raises:
        ValueError: one line starting with the file name: a missing or unreadable file, an
            unknown extension, a syntax error (``"<file>:<line>:<column>: ..."``), a top level
            that is not a table, or invalid fields (``"<file>: chatbot.turns_mean: unknown field
            (valid: ...)"``, :func:`balancer.validation.format_validation_error`).
    """
    import json
    import tomllib

    import yaml
    from pydantic import ValidationError

    from balancer.validation import format_validation_error, syntax_error_line

    p = os.fspath(path)
    if not p.endswith((".json", ".toml", ".yaml", ".yml")):
        raise ValueError(f"{p}: unknown config extension (use .json, .toml or .yaml)")
    try:
        with open(p, "rb") as fh:
            text = fh.read().decode()
    except FileNotFoundError:
        raise ValueError(f"{p}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{p}: cannot read: {e}") from None
    try:
        if p.endswith(".json"):
            data = json.loads(text)
        elif p.endswith(".toml"):
            data = tomllib.loads(text)
        else:
            data = yaml.safe_load(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError, yaml.YAMLError) as e:
        raise ValueError(syntax_error_line(p, e)) from None
    except RecursionError:
        raise ValueError(f"{p}: nested too deeply") from None
    if not isinstance(data, dict):
        raise ValueError(f"{p}: the top level must be a table of SessionWorkloadConfig fields, got {type(data).__name__}")
    try:
        return SessionWorkloadConfig.model_validate(data)
    except ValidationError as e:
        raise ValueError(format_validation_error(e, source=p, model=SessionWorkloadConfig)) from None
