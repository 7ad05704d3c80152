"""``pdlb serve``'s garbage-collector tuning (:func:`balancer.service.launch.tune_gc`), run in a child
interpreter so that the test process keeps its own collector settings."""

import json
import subprocess
import sys

from balancer.service.launch import GC_GEN0_THRESHOLD


def test_tune_gc_freezes_the_startup_heap_and_raises_the_young_threshold():
    code = ("import gc, json; import balancer.service.app; from balancer.service.launch import tune_gc; "
            "before = gc.get_threshold(); tune_gc(); "
            "print(json.dumps([before, gc.get_threshold(), gc.get_freeze_count(), gc.get_count()[0]]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    before, after, frozen, young = json.loads(out)
    assert after == [GC_GEN0_THRESHOLD, before[1], before[2]]  # only the young generation's threshold changes
    assert GC_GEN0_THRESHOLD == 10_000
    # the imported service (aiohttp, pydantic, numpy, prometheus-client) is tens of thousands of
    # container objects, all moved to the permanent generation; the young generation starts empty
    assert frozen > 20_000
    assert young < 100
