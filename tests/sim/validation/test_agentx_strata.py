"""Per-request prompt-cache strata (sim/validation/agentx_strata.py) and the published strata of
AgentX 440845's reproduction (sim/data/measured/agentx_440845_request_strata.json).

Expected values: by hand (bucket edges from aisimulate's analyze_requests.py, small examples worked
out below), and the published file's own totals (its buckets must add up to them)."""

import math

import numpy as np

import pytest

from sim.validation import agentx_strata as st
from sim.workload.agentic import AgenticWorkloadConfig


@pytest.mark.parametrize(("uncached", "bucket"), [
    (0, "0"), (1, "<=8K"), (8192, "<=8K"), (8193, "(8K,32K]"), (32768, "(8K,32K]"), (32769, "(32K,128K]"),
    (131072, "(32K,128K]"), (131073, "(128K,256K]"), (262144, "(128K,256K]"), (262145, ">256K")])
def test_uncached_bucket_edges_are_analyze_requests_edges(uncached, bucket) -> None:
    # analyze_requests.py: <=8192, <=32768, <=131072, <=262144 (inclusive), '0' only for zero
    assert st.uncached_bucket(uncached) == bucket


@pytest.mark.parametrize(("reuse", "bucket"), [
    (0.0, "0%"), (1e-9, "(0,90%)"), (0.8999, "(0,90%)"), (0.9, "[90,99%)"), (0.9899, "[90,99%)"),
    (0.99, "[99,100%)"), (0.999999, "[99,100%)"), (1.0, "100%")])
def test_reuse_bucket_edges(reuse, bucket) -> None:
    assert st.reuse_bucket(reuse) == bucket


def test_request_strata_by_hand() -> None:
    # prompts / cached -> uncached: 10,000/0 -> 10,000; 100,000/99,000 -> 1,000; 50,000/40,000 -> 10,000;
    # 300,000/0 -> 300,000. Reuse: 0, 0.99, 0.8, 0.
    s = st.request_strata([10_000, 100_000, 50_000, 300_000], [0, 99_000, 40_000, 0])
    assert s["total"] == {"requests": 4, "prompt_tokens": 460_000, "uncached_tokens": 321_000}
    assert s["uncached"] == {
        "<=8K": {"requests": 1, "prompt_tokens": 100_000, "uncached_tokens": 1_000},
        "(8K,32K]": {"requests": 2, "prompt_tokens": 60_000, "uncached_tokens": 20_000},
        ">256K": {"requests": 1, "prompt_tokens": 300_000, "uncached_tokens": 300_000}}
    assert s["reuse"] == {
        "0%": {"requests": 2, "prompt_tokens": 310_000, "uncached_tokens": 310_000},
        "(0,90%)": {"requests": 1, "prompt_tokens": 50_000, "uncached_tokens": 10_000},
        "[99,100%)": {"requests": 1, "prompt_tokens": 100_000, "uncached_tokens": 1_000}}


@pytest.mark.parametrize(("prompts", "cached", "match"), [
    ([1.0, 2.0], [0.0], "2 prompts but 1"),
    ([], [], "1..10,000,000 requests"),
    ([100.0], [101.0], "in \\[0, prompt\\]"),
    ([100.0], [-1.0], "in \\[0, prompt\\]"),
    ([0.0], [0.0], "every prompt > 0"),
    ([math.nan], [0.0], "finite"),
    ([100.0], [math.inf], "finite"),
])
def test_request_strata_refuses_bad_input(prompts, cached, match) -> None:
    with pytest.raises(ValueError, match=match):
        st.request_strata(prompts, cached)


@pytest.mark.parametrize("case", ["off", "on"])
def test_published_strata_add_up_to_their_totals(case) -> None:
    # transcription check: each dimension's buckets sum to the file's totals (3,423 / 3,399 requests)
    d = st.load_strata_440845(case)
    for dim in ("uncached", "reuse"):
        for k in ("requests", "prompt_tokens", "uncached_tokens"):
            assert sum(b[k] for b in d[dim].values()) == d["total"][k]
    # 0% reuse means nothing cached: prompt == uncached in that bucket
    assert d["reuse"]["0%"]["prompt_tokens"] == d["reuse"]["0%"]["uncached_tokens"]


def test_published_reuse_is_440246s_theoretical_hit_rate() -> None:
    # 1 - 15,942,155 / 510,013,963 = 0.96874: the same corpus' theoretical 0.9687 of point 440246
    d = st.load_strata_440845("off")
    reuse = 1 - d["total"]["uncached_tokens"] / d["total"]["prompt_tokens"]
    assert reuse == pytest.approx(0.968742, abs=1e-6)
    assert round(reuse, 4) == 0.9687
    # the fresh-context requests: 178 of 3,423 (5.2%), mean prompt 5,471,947 / 178 = 30,741 tokens,
    # carrying 5,471,947 / 15,942,155 = 34.3% of the uncached tokens
    rows = {(r.dimension, r.bucket): r for r in st.compare_strata(d, d)}
    r0 = rows[("reuse", "0%")]
    assert r0.published_share == pytest.approx(178 / 3423)
    assert r0.published_mean_prompt == pytest.approx(30_741.27, abs=0.01)
    assert r0.published_uncached_share == pytest.approx(0.34324, abs=1e-5)
    assert r0.simulated_share == r0.published_share  # same input on both sides


def test_load_strata_unknown_case() -> None:
    with pytest.raises(KeyError, match="no case 'x'"):
        st.load_strata_440845("x")


def test_compare_strata_by_hand_with_a_missing_bucket() -> None:
    sim = st.request_strata([10_000, 100_000, 50_000, 300_000], [0, 99_000, 40_000, 0])
    pub = st.request_strata([1_000, 2_000], [0, 1_000])  # uncached 1,000 / 1,000; reuse 0% and (0,90%)
    rows = {(r.dimension, r.bucket): r for r in st.compare_strata(sim, pub)}
    r = rows[("uncached", "<=8K")]
    assert (r.published_share, r.simulated_share) == (1.0, 0.25)
    assert (r.published_mean_uncached, r.simulated_mean_uncached) == (1_000, 1_000)
    assert (r.published_uncached_share, r.simulated_uncached_share) == (1.0, pytest.approx(1_000 / 321_000))
    gone = rows[("uncached", ">256K")]  # only the simulated side has it
    assert (gone.published_share, gone.published_uncached_share, gone.simulated_share) == (0.0, 0.0, 0.25)
    # no published request in it: its means are undefined (NaN), not 0 tokens (review finding 2);
    # the simulated side's one request: prompt 300,000, all uncached
    assert math.isnan(gone.published_mean_uncached) and math.isnan(gone.published_mean_prompt)
    assert (gone.simulated_mean_uncached, gone.simulated_mean_prompt) == (300_000, 300_000)
    assert ("uncached", "0") not in rows and ("reuse", "100%") not in rows  # neither side has them
    assert [k for k in rows if k[0] == "uncached"] == [("uncached", b) for b in ("<=8K", "(8K,32K]", ">256K")]


def test_generator_strata_by_hand() -> None:
    # every sigma 0: 1 + 2 = 3 turns, prompts 1,000, 1,000 + 50 + 100 = 1,150, 1,300, outputs 50;
    # start ratio 0 -> every trajectory from turn 0. The server reuses the previous prompt:
    # cached 0, 1,000, 1,150 -> uncached 1,000, 150, 150 (all <=8K); reuse 0, 0.870, 0.885
    c = AgenticWorkloadConfig(lanes=1, warmup_requests_per_lane=0, start_min_ratio=0, start_max_ratio=0,
                              turns_median=2, turns_sigma=0, initial_context_median_tokens=1000,
                              initial_context_sigma=0, new_tokens_median=100, new_tokens_sigma=0,
                              new_tokens_trajectory_sigma=0, output_median_tokens=50, output_sigma=0)
    s = st.generator_strata(c, requests_per_lane=3)
    assert s["uncached"] == {"<=8K": {"requests": 3, "prompt_tokens": 3_450, "uncached_tokens": 1_300}}
    assert s["reuse"] == {"0%": {"requests": 1, "prompt_tokens": 1_000, "uncached_tokens": 1_000},
                          "(0,90%)": {"requests": 2, "prompt_tokens": 2_450, "uncached_tokens": 300}}
    with pytest.raises(ValueError, match="requests_per_lane"):
        st.generator_strata(c, requests_per_lane=0)


# --- subagent fan-out (AgenticWorkloadConfig.subagent_*), the structure the strata point to ---

def _det(**kw) -> AgenticWorkloadConfig:
    # every sigma 0: parents of 1 + 2 = 3 turns from 1,000 tokens, subagents of 1 + 1 = 2 turns from
    # 500 tokens; new tokens 100, outputs 50 everywhere
    base = dict(lanes=1, warmup_requests_per_lane=0, start_min_ratio=0, start_max_ratio=0, turns_median=2,
                turns_sigma=0, initial_context_median_tokens=1000, initial_context_sigma=0, new_tokens_median=100,
                new_tokens_sigma=0, new_tokens_trajectory_sigma=0, output_median_tokens=50, output_sigma=0,
                subagent_turns_median=1, subagent_turns_sigma=0, subagent_context_median_tokens=500,
                subagent_context_sigma=0)
    return AgenticWorkloadConfig(**{**base, **kw})


def test_subagents_run_between_parent_turns_with_fresh_contexts_by_hand() -> None:
    from sim.workload.agentic import lane_turns
    it = lane_turns(_det(subagent_spawn_probability=1.0), 0)
    got = [(t.session, t.turn, t.input_tokens, t.reusable_tokens, t.server_reusable_tokens, t.first_of_trajectory)
           for t in (next(it) for _ in range(8))]
    # parent 1,000 -> 1,150 -> 1,300; after each parent turn but the last, a subagent 500 -> 650
    # (500 + 50 + 100); the parent's next turn still extends its own previous prompt
    assert got == [
        ("lane0-traj0", 0, 1000, 0, 0, True),
        ("lane0-traj0-sub0", 0, 500, 0, 0, True),
        ("lane0-traj0-sub0", 1, 650, 550, 500, False),
        ("lane0-traj0", 1, 1150, 1050, 1000, False),
        ("lane0-traj0-sub1", 0, 500, 0, 0, True),
        ("lane0-traj0-sub1", 1, 650, 550, 500, False),
        ("lane0-traj0", 2, 1300, 1200, 1150, False),
        ("lane0-traj1", 0, 1000, 0, 0, True),  # no subagent after a trajectory's last turn
    ]


def test_no_fanout_leaves_the_stream_unchanged() -> None:
    from sim.workload.agentic import lane_turns
    # probability 0 draws nothing more from the lane's RNG: the default stream is the old one, and
    # the subagent fields do not matter
    a = AgenticWorkloadConfig(lanes=2)
    b = AgenticWorkloadConfig(lanes=2, subagent_turns_median=50, subagent_context_median_tokens=1e5)
    for lane in range(2):
        ia, ib = lane_turns(a, lane), lane_turns(b, lane)
        assert [next(ia) for _ in range(200)] == [next(ib) for _ in range(200)]


def test_fanout_share_of_subagent_requests_by_formula() -> None:
    # with probability p after each of a parent's T - 1 non-final turns and n turns per subagent, the
    # subagent share of requests is p (T - 1) n / (T + p (T - 1) n): T = 3, n = 2, p = 0.5 -> 2 / 5
    from sim.workload.agentic import lane_turns
    it = lane_turns(_det(subagent_spawn_probability=0.5, seed=3), 0)
    turns = [next(it) for _ in range(20_000)]
    share = sum("-sub" in t.session for t in turns) / len(turns)
    assert share == pytest.approx(0.4, abs=0.02)


@pytest.mark.parametrize("field", ["subagent_spawn_probability", "subagent_turns_median",
                                   "subagent_context_median_tokens"])
def test_fanout_fields_refuse_bad_values(field) -> None:
    from pydantic import ValidationError
    with pytest.raises(ValidationError):
        AgenticWorkloadConfig(**{field: -1.0})
    if field == "subagent_spawn_probability":
        with pytest.raises(ValidationError):
            AgenticWorkloadConfig(subagent_spawn_probability=1.5)


def test_parent_turn_after_its_subagent_keeps_its_prefix_in_the_closed_loop() -> None:
    # the closed loop remembers each session's last prompt (a parent and its subagent interleave in
    # one lane): a parent turn right after a subagent resumes at its own previous prompt's blocks,
    # never at the subagent's; a subagent's first turn is cold
    from sim.validation.agentx import simulate_440246
    wl = AgenticWorkloadConfig(lanes=8, duration_s=200.0, warmup_requests_per_lane=2, subagent_spawn_probability=0.5)
    r = simulate_440246(wl)
    rec = r.records
    last: dict[str, int] = {}
    lane_prev: dict[str, str] = {}  # the lane's previous request's session
    after_sub = hits_after_sub = 0
    for i, session in enumerate(r.sessions):
        j = last.get(session)
        lane = session.split("-")[0]
        before, lane_prev[lane] = lane_prev.get(lane, ""), session
        if np.isnan(rec.prefill_end_s[i]):
            last[session] = i
            continue
        if j is None:
            assert rec.cached_tokens[i] == 0  # a first turn (parent or subagent) is cold
        else:
            assert rec.cached_tokens[i] <= rec.prompt_tokens[j]
            if "-sub" not in session and "-sub" in before:
                after_sub += 1
                hits_after_sub += rec.cached_tokens[i] > 0
        last[session] = i
    assert after_sub > 0 and hits_after_sub > 0.5 * after_sub


def test_plot_strata_writes_a_png(tmp_path) -> None:
    sim = st.request_strata([10_000, 100_000, 50_000, 300_000], [0, 99_000, 40_000, 0])
    out = st.plot_strata({"hand example": sim}, tmp_path / "strata.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("width", [120, 160])  # 160: what pdlb gives a file or a pipe (pdlb_cli.main)
def test_strata_table_rows_stay_on_one_line_in_a_file(width) -> None:
    # review2: `pdlb sim validate --agentx-440246 > file` wrapped "uncached (128K,256K]" onto two
    # rows. The widest real figures (docs/validate.md's table): every bucket is one line, whole.
    import io

    from rich.console import Console

    rows = [st.StrataRow(d, b, 0.912, 0.880, 184_547, 169_532, 0.387, 0.284, 269_176, 384_376)
            for d, bs in (("uncached", st.UNCACHED_BUCKETS[1:]), ("reuse", st.REUSE_BUCKETS[:-1])) for b in bs]
    out = io.StringIO()
    st.print_strata(rows, Console(file=out, width=width), "strata")
    lines = out.getvalue().splitlines()
    body = [ln for ln in lines if ln.startswith("│ uncached") or ln.startswith("│ reuse")]
    assert len(body) == len(rows) == 9
    for r, ln in zip(rows, body):
        assert f"{r.dimension} {r.bucket}" in ln
        assert "91.2% / 88.0%" in ln and "269,176 / 384,376" in ln and "38.7% / 28.4%" in ln
    assert "reuse 0% (cold)" in out.getvalue()  # docs/validate.md's label
    assert max(len(ln) for ln in lines) <= width


def test_print_strata_shows_a_dash_for_an_empty_buckets_mean() -> None:
    # review finding 2: `pdlb sim validate --agentx-440246 --duration-s 120` printed an empty simulated
    # bucket's mean prompt and mean uncached tokens as 0
    from rich.console import Console
    sim = st.request_strata([10_000], [9_000])  # one request: uncached 1,000 (<=8K), reuse 90% ([90,99%))
    pub = st.request_strata([1_000, 300_000], [0, 0])  # uncached 1,000 (<=8K) and 300,000 (>256K)
    console = Console(width=160, record=True)
    st.print_strata(st.compare_strata(sim, pub), console, "t")
    line = next(ln for ln in console.export_text().splitlines() if "uncached >256K" in ln)
    cells = [c.strip() for c in line.split("\u2502")[1:-1]]
    # bucket | requests 440845 / sim | mean prompt | mean uncached | share of uncached tokens
    assert cells == ["uncached >256K", "50.0% / 0.0%", "300,000 / -", "300,000 / -", "99.7% / 0.0%"]
