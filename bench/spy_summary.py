"""Summarise a py-spy ``record -f raw -t`` profile (collapsed stacks, one thread name first):
samples per thread, the frames with the most samples inclusive and as the leaf.

  python3 bench/spy_summary.py PROFILE.raw [--top 30]
"""

from __future__ import annotations

import argparse
import collections
import signal
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("profile")
    ap.add_argument("--top", type=int, default=30)
    a = ap.parse_args(argv)
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
            total += int(n)
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
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # piped into head: stop quietly
    sys.exit(main())
