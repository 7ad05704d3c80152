"""README's "Models: presets" paragraph names every preset the simulator ships (issue 25 review
F9: `deepseek-v4-pro`, the model of AgentX 440246, was missing) and its demo waits on /health."""

from __future__ import annotations

import re
from pathlib import Path

from sim.models.presets import MODELS

README = (Path(__file__).resolve().parents[3] / "README.md").read_text()


def test_readme_lists_every_model_preset():
    start = README.index("Models: presets")
    paragraph = README[start:README.index("\n\n", start)]
    named = set(re.findall(r"`([a-z0-9.\-]+)`", paragraph))
    assert set(MODELS) <= named, sorted(set(MODELS) - named)


def test_readme_demo_waits_for_the_router_instead_of_sleeping():
    demo = README[README.index("**Two-minute local demo**"):]
    demo = demo[:demo.index("```\n", demo.index("```bash") + 7)]
    assert "sleep 5" not in demo
    assert "localhost:8000/health" in demo
