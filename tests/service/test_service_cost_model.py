"""The cost model in the live router: files, errors, and online learning through the proxy."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

from balancer.cost_model import CostModel
from balancer.service.app import SERVICE
from pdlb_cli.serve import read_cost_model_file
from pdlb_cli.main import main
from sim.emulator.testing import inprocess_cluster


@pytest.mark.parametrize("suffix", [".toml", ".json", ""])
def test_sim_cost_model_file_round_trips_into_serve(tmp_path: Path, suffix: str) -> None:
    # what pdlb sim cost-model writes (TOML, or JSON for .json) is what pdlb serve --cost-model reads
    from sim.run.router_cost import cost_model_for
    from sim.scenario import load_scenario

    out = tmp_path / f"cm{suffix}"
    assert main(["sim", "cost-model", "--scenario", "llama70b-pd-h100", "--out", str(out)]) == 0
    assert CostModel.from_dict(read_cost_model_file(str(out))) == cost_model_for(load_scenario("llama70b-pd-h100"))


@pytest.mark.parametrize("text, message", [
    ("[cost_model]\nprefill = 3\n", "cost_model.prefill: expected a table"),
    ("[cost_model.prefill]\nprefill = 5\n", "cost_model.prefill.prefill: expected a table"),
    ("[cost_model]\nengines = 5\n", "cost_model.engines: expected a table"),
    ("[cost_model.prefill]\nep_synchronous = \"false\"\n", "ep_synchronous must be true or false"),
    ("[cost_model.prefill]\nchunk_tokens = 1.5\n", "chunk_tokens must be an integer"),
    ("[cost_model]\ntransfer_latency_s = true\n", "cost_model.transfer_latency_s must be a finite number"),
    ("[cost_model.decode.decode]\nper_seq_s = -1\n", "cost_model.decode.decode.per_seq_s must be"),
    ("[cost_model.prefill.decode]\nper_seq_s = -1\n", "cost_model.prefill.decode.per_seq_s must be"),
    ("[cost_model.prefill.prefill]\nper_tokens = 1\n", "unknown term(s) per_tokens"),
    ("not toml [", "not valid TOML"),
])
def test_bad_cost_model_files_are_one_clear_error(tmp_path: Path, text: str, message: str) -> None:
    f = tmp_path / "cm.toml"
    f.write_text(text)
    with pytest.raises(ValueError) as e:
        read_cost_model_file(str(f))
    assert message in str(e.value) and str(f) in str(e.value)


async def test_the_service_learns_prefill_and_decode_from_what_it_relays():
    # streamed answers give the inter-token latency (SSE events ~ output tokens); every request
    # with a prefill leg gives a prefill time
    router = {"prefill_policy": {"name": "ep_aware"}, "decode_policy": {"name": "ep_aware"}}
    async with inprocess_cluster("sglang", engine={"speed": 20.0}, router=router) as c, aiohttp.ClientSession() as s:
        learner = c.router.app[SERVICE].router.cost_learner
        assert learner is not None
        for i in range(6):
            async with s.post(c.url + "/v1/completions",
                              json={"prompt": f"q {i} " * 50, "max_tokens": 8, "stream": True}) as r:
                assert r.status == 200
                await r.read()
        n = learner.num_observations
        assert n["prefill"] == 6 and n["decode"] == 6, n


def test_sim_cost_model_takes_set_like_sim_run(tmp_path: Path, capsys) -> None:
    # --set on cost-model = --set on sim run: the same dotted scenario fields, applied in order
    from sim.run.router_cost import cost_model_for
    from sim.scenario import load_scenario

    out = tmp_path / "cm.toml"
    assert main(["sim", "cost-model", "--scenario", "llama70b-pd-h100", "--set", "prefill.max_prefill_tokens=4096",
                 "--set", "kv_transfer_latency_s=0.5", "--set", "kv_transfer_latency_s=0.005", "--out", str(out)]) == 0
    got = CostModel.from_dict(read_cost_model_file(str(out)))
    # by hand: the chunk is the pool's max_prefill_tokens, the transfer latency the scenario's (last --set wins)
    assert got.prefill.chunk_tokens == 4096 and got.transfer_latency_s == 0.005
    base = load_scenario("llama70b-pd-h100")
    independent = base.model_copy(update={"prefill": base.prefill.model_copy(update={"max_prefill_tokens": 4096}),
                                          "kv_transfer_latency_s": 0.005})
    assert got == cost_model_for(independent)
    assert got != cost_model_for(base)
    assert "--set prefill.max_prefill_tokens=4096" in out.read_text().splitlines()[0]
    capsys.readouterr()
    assert main(["sim", "cost-model", "--set", "prefill.max_prefil_tokens=4096"]) == 2
    assert capsys.readouterr().err == ("error: --set on scenario 'dsv3-pd-h200': prefill.max_prefil_tokens: unknown "
                                       "field (did you mean 'max_prefill_tokens'?)\n")


def test_vllm_chunk_limit_and_cadence_reach_pdlb_serve_from_sim_cost_model(tmp_path: Path) -> None:
    # issue 23 part 3: the pool's vLLM options become cost-model table keys that pdlb serve reads back
    from pdlb_cli.main import build_parser
    from pdlb_cli.serve import config_from_args

    out = tmp_path / "cm.toml"
    assert main(["sim", "cost-model", "--scenario", "llama8b-agg-h100", "--set", "mixed.max_num_seqs=16",
                 "--set", "mixed.max_chunk_tokens=512", "--set", "mixed.prefill_schedule_interval=8",
                 "--out", str(out)]) == 0
    lines = out.read_text().splitlines()
    assert "request_chunk_tokens = 512" in lines and "prefill_schedule_interval = 8" in lines
    cm = config_from_args(build_parser().parse_args(["serve", "--cost-model", str(out)])).router.cost_model
    cm = cm if isinstance(cm, CostModel) else CostModel.from_dict(cm)
    for eng in (cm.prefill, cm.decode):  # an aggregated scenario: the mixed pool's model serves both
        assert (eng.request_chunk_tokens, eng.prefill_schedule_interval, eng.max_num_seqs) == (512, 8, 16)
    # without the options the table has neither key (the files written before are read the same)
    plain = tmp_path / "plain.toml"
    assert main(["sim", "cost-model", "--scenario", "llama8b-agg-h100", "--out", str(plain)]) == 0
    assert "request_chunk_tokens" not in plain.read_text() and "prefill_schedule_interval" not in plain.read_text()


def test_mtp_accepted_tokens_per_step_reach_pdlb_serve_from_sim_cost_model(tmp_path: Path) -> None:
    # issue 23 part 3: a scenario verifying MTP drafts on every step (acceptance 0.8, 0.5, 0.3: tau = 1 + 0.8
    # + 0.8 x 0.5 + 0.8 x 0.5 x 0.3 = 2.32 by hand) writes decode_tokens_per_step, which pdlb serve reads back
    from pdlb_cli.main import build_parser
    from pdlb_cli.serve import config_from_args

    out = tmp_path / "cm.toml"
    assert main(["sim", "cost-model", "--scenario", "llama8b-agg-h100", "--set", "speculative.draft_tokens=3",
                 "--set", "speculative.acceptance=[0.8,0.5,0.3]", "--set", "speculative.verify=every_step",
                 "--out", str(out)]) == 0
    cm = config_from_args(build_parser().parse_args(["serve", "--cost-model", str(out)])).router.cost_model
    cm = cm if isinstance(cm, CostModel) else CostModel.from_dict(cm)
    for eng in (cm.prefill, cm.decode):
        assert eng.decode_tokens_per_step == pytest.approx(2.32, rel=1e-12)
    # the mean-field model already prices a step per accepted token: no key (1 token per step)
    mf = tmp_path / "mf.toml"
    assert main(["sim", "cost-model", "--scenario", "llama8b-agg-h100", "--set", "speculative.draft_tokens=3",
                 "--set", "speculative.acceptance=[0.8,0.5,0.3]", "--out", str(mf)]) == 0
    assert "decode_tokens_per_step" not in mf.read_text()
