"""Compare py-spy profiles of the worker taken in slices during two phases of a run (e.g. the
replay's S=64 multi-weight then single-weight calls): per phase, the samples per second in the
device job (frames under ``Batcher.run_now`` / ``Batcher._job``) and where they sit, by the
deepest frame in kernels/ or service/ (file:line), and the busiest frames overall.

    python3 bench/replay_spy.py SLICES.txt [--top 25]

``SLICES.txt``: one line per slice, ``PROFILE.raw TAG`` (a ``py-spy record -f raw`` output of
that slice and the phase it fell in); slices of one tag are added up.
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

JOB = ("Batcher.run_now", "Batcher._job")


def _ours(frame: str) -> bool:
    return "kernels/" in frame or "service/" in frame or "cupy" in frame


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("slices")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args(argv)
    total: collections.Counter[str] = collections.Counter()
    job: collections.Counter[str] = collections.Counter()
    where: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    busy: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    nslices: collections.Counter[str] = collections.Counter()
    for line in Path(a.slices).read_text().splitlines():
        path, _, tag = line.partition(" ")
        p = Path(path)
        if not p.exists():
            continue
        nslices[tag] += 1
        for row in p.read_text().splitlines():
            stack, _, n = row.rpartition(" ")
            if not n.isdigit():
                continue
            frames, k = stack.split(";"), int(n)
            if "select" in frames[-1] or "wait (threading" in frames[-1]:
                continue  # idle
            total[tag] += k
            for f in set(frames):
                if _ours(f):
                    busy[tag][f] += k
            if any(any(j in f for j in JOB) for f in frames):
                job[tag] += k
                deep = [f for f in frames if _ours(f)]
                where[tag][deep[-1] if deep else frames[-1]] += k
    for tag in sorted(nslices):
        print(f"## {tag}: {nslices[tag]} slices, {total[tag]} busy samples, {job[tag]} in the "
              "device job")
        for f, k in where[tag].most_common(a.top):
            print(f"  job {k:6d}  {f}")
        for f, k in busy[tag].most_common(a.top):
            print(f"  all {k:6d}  {f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
