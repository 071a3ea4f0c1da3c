"""Summarise a py-spy ``record -f raw -t`` profile (collapsed stacks, one thread name first):
samples per thread, the frames with the most samples inclusive and as the leaf.

  python3 bench/spy_summary.py PROFILE.raw [--top 30] [--thread TEXT] [--under NAME --depth D]

``--thread``: only the threads whose name has TEXT (e.g. MainThread: the event loop).
``--under NAME``: also split the samples whose stack has a frame with NAME in it by the ``D``
frames called below its last such frame (file paths cut to their names, line numbers and
unnamed native addresses dropped, so one function is one row): e.g. ``--under MatmulStream``
with a ``--native`` profile splits the handler's step into gRPC's read, our Python, the job
and gRPC's write, C frames included.
"""

from __future__ import annotations

import argparse
import collections
import re
import signal
import sys

_LINE = re.compile(r"\(([^()]*/)?([^()/]*?)(:\d+)?\)$")


def short(frame: str) -> str:
    """``frame`` without its file's folders and line: ``func (file.py)``; an unnamed native
    address as ``? (lib)``."""
    frame = _LINE.sub(lambda m: f"({m.group(2)})", frame)
    return "? " + frame.partition(" ")[2] if frame.startswith("0x") else frame


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("profile")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--thread", default="", help="only threads whose name has this")
    ap.add_argument("--under", default="", help="split the stacks under this frame")
    ap.add_argument("--depth", type=int, default=2, help="frames below --under per row")
    a = ap.parse_args(argv)
    under: collections.Counter[str] = collections.Counter()
    n_under = 0
    threads: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    leaf: collections.Counter[str] = collections.Counter()
    total = 0
    with open(a.profile) as f:
        for line in f:
            stack, _, n = line.rstrip().rpartition(" ")
            if not n.isdigit():
                continue
            frames = stack.split(";")
            if a.thread and a.thread not in frames[0]:
                continue
            total += int(n)
            if a.under:
                hits = [i for i, fr in enumerate(frames) if a.under in fr]
                if hits:
                    n_under += int(n)
                    below = [short(fr) for fr in frames[hits[-1] + 1:]]
                    below = [fr for fr in below if not fr.startswith("? ")]
                    under[" > ".join(below[: a.depth]) or "(itself)"] += int(n)
            threads[frames[0]] += int(n)
            leaf[frames[-1]] += int(n)
            for fr in set(frames[1:]):
                inclusive[fr] += int(n)
    print(f"samples {total}")
    for name, n in threads.most_common():
        print(f"  {n:6d} {name}")
    for title, counts in (("inclusive", inclusive), ("leaf", leaf)):
        print(title)
        for name, n in counts.most_common(a.top):
            print(f"  {n:6d} {100 * n / max(1, total):5.1f}% {name[:130]}")
    if a.under:
        print(f"under {a.under}: {n_under} samples ({100 * n_under / max(1, total):.1f}%), "
              f"by the {a.depth} frames below it (% of those)")
        for name, n in under.most_common(a.top):
            print(f"  {n:6d} {100 * n / max(1, n_under):5.1f}% {name[:160]}")
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # piped into head: stop quietly
    sys.exit(main())
