"""An emulated SGLang/vLLM engine: a real HTTP server timed by the simulator's perf model.

``pdlb engine --role prefill|decode|mixed --speed F`` (:mod:`pdlb_cli.engine`); the app is
:func:`sim.emulator.app.create_engine_app`, the scheduler :class:`sim.emulator.engine.EngineCore`.
"""

from sim.emulator.app import create_engine_app
from sim.emulator.config import EmulatorConfig, FaultConfig
from sim.emulator.engine import EngineCore

__all__ = ["EmulatorConfig", "EngineCore", "FaultConfig", "create_engine_app"]
