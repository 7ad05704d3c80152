"""bench/real_engines.py end to end on CPU: two emulated engines framing their streams as
``transformers serve`` does (a role-only chunk before prefill, no ``[DONE]``), ``pdlb serve`` in
front, the openai client driving them. Slow (about 25 s here: three processes start); skipped
without the ``openai`` package (``pip install 'pdlb[bench]'``)."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest

pytest.importorskip("openai")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
real_engines = pytest.importorskip("real_engines")


def _free_base_port() -> int:
    """A port P with P, P + 1 and P + 99 free now (the engines' and the router's)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + 99 > 65535:
            continue
        try:
            socks = []
            for p in (base, base + 1, base + 99):
                t = socket.socket()
                socks.append(t)
                t.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()
    raise RuntimeError("no free port range")


@pytest.mark.slow
def test_bench_measures_pdlb_ttft_against_the_client(tmp_path):
    out = tmp_path / "res.json"
    for _attempt in range(3):  # exit 2 = setup failed: a port found free was taken meanwhile (the
        # router's port lies among the ephemeral ports that other connections on this host use)
        code = real_engines.main(["--requests", "8", "--concurrency", "1", "--speed", "0.25", "--base-port",
                                  str(_free_base_port()), "--logs", str(tmp_path / "logs"), "--out", str(out)])
        if code != 2:
            break
    res = json.loads(out.read_text())
    assert code in (0, 1) and res["errors"] == []
    assert res["streamed_measured"] == 4 and res["pdlb_ttft_observations"] == 4
    # the role chunk comes before prefill, the first token after it: the metric follows the token
    assert res["client_first_chunk_mean_s"] < 0.5 * res["client_ttft_mean_s"]
    assert 0.8 <= res["ratio_pdlb_over_client"] <= 1.0 + 1e-9
