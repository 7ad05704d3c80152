"""Imported as a --policy-module by the Ray test's workers: with PDLB_TEST_KILL_WORKER=1 (set only
in the Ray workers' environment) it notes the attempt in PDLB_TEST_KILL_LOG and kills its process,
as an out-of-memory kill would."""

import os

if os.environ.get("PDLB_TEST_KILL_WORKER") == "1":
    with open(os.environ["PDLB_TEST_KILL_LOG"], "a") as fh:
        fh.write(f"{os.getpid()}\n")
    os._exit(1)
