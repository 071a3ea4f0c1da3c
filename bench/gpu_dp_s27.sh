#!/usr/bin/env bash
# Session 26, issue 15 (dp), one script for the bundles (session 25's, PHASE=a/b/c: T3 over
# system regions with Q6SERVE_DP_TICK_LEAN, the lane row's launch slots, py-spy of the device
# process: `git show b76a477:bench/gpu_dp_s25.sh`, docs/SCALEOUT.md "Session 25").
#  a (bound 100 s, bundle A): where T2's slowest calls wait, and the lanes' device process by stage.
#    1. T2's timeline (bench/t2_timeline.py: 64 callers of N=1 on ffn_down 3584x18944 as 8 load
#       processes x 8, front ends round robin, TL_RUNS runs of TL_S s on one worker, the device
#       process's counters on) with TL_FIRST (f6: 6 front ends) first, RUNS next, TL_LAST (f8)
#       last (session 20's one pair on a slow host: 8 held p99 ~1 ms lower), its calls kept; the
#       heredoc below reads them: whether the slowest 1% come in episodes (the mean round trip
#       of the calls that ended within 0.5 / 2 ms of each, of its own front end's and of the
#       others' within 1 ms; the share of them in the worst tenth of 10 ms windows) or one by
#       one (callers; the device batches answered between a call's hand-off and its own
#       answer; the stacks its front end got answered while it waited in its stack), and which
#       part is the largest in each. The calls come back as $FINAL/RUN_calls.npz (us, int32).
#    2. RUNS (default "lane"; also "t3"), one run each, the device process's stages timed
#       (Q6SERVE_DP_STATS, bench/device_stats_table.py --stages): the lane row (T3's shape
#       through the fast lane, the closing check's LANE=1: 8 hosts x 1 caller of N=64,
#       --frontends 2), whose stages (lane_request / lane_flush / lane_answer) have not run on a
#       GPU yet; bench/service.py's T3 over system regions (6 front ends round robin).
#  b (bound 100 s, bundle B): T2's timeline alternated over TL_VARIANTS (ab_runs' NAME[:VAR=VALUE,...],
#    NAME fN...: N front ends; default "f6 f8 f8 f6"), TL_RUNS (here 1) runs each, read as in a.
# No run starts past BOUND - NEED s; a table last.
#   bench/gpu_dp_s26.sh   env: PHASE (a), BOUND (95), NEED (12), BACKEND (cuda; numpy: a CPU
#                         rehearsal with DRY_RUN=1), TL_FIRST (f6), TL_LAST (f8), TL_RUNS (2),
#                         TL_S (2), RUNS, HOSTS (8), SECONDS_PER_RUN (1.5)
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/dp
PHASE=${PHASE:-a} BOUND=${BOUND:-95} BACKEND=${BACKEND:-cuda}
ROWS=3584 K=18944
[[ $BACKEND == numpy ]] && ROWS=256 K=3584
timeline() {  # timeline RUN NAME: T2's timeline (NAME fN...: N front ends), its calls kept in $OUT/RUN
  local fe=${2#f}
  fe=${fe%%[!0-9]*}
  Q6SERVE_FRONTEND_ROUND_ROBIN=1 Q6SERVE_DP_STATS=$OUT/dpstats_$1.jsonl \
    timeout "$(bound $((14 + ${TL_RUNS:-2} * (${TL_S:-2} + 4))) 6)" python3 bench/t2_timeline.py \
    --backend "$BACKEND" --rows $ROWS --k $K --frontends "$fe" --hosts "${HOSTS:-8}" --callers 8 \
    --seconds "${TL_S:-2}" --warmup 0.5 --runs "${TL_RUNS:-2}" --keep "$OUT/$1" \
    --json "$OUT/$1.json" >"$OUT/$1.log" 2>&1
  note "# $1 (T2's timeline) rc=$? at $(elapsed)"
  timeout "$(bound 20 1)" python3 - "$OUT/$1" "$FINAL/$1_calls.npz" >"$OUT/$1.tail" 2>&1 <<'EOF'
# the kept calls of bench/t2_timeline.py --keep: where the slowest 1% wait (the script's header)
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, "bench")
from t2_timeline import COLS, PARTS, timeline  # noqa: E402

keep = {}
for f in sorted(Path(sys.argv[1]).glob("calls-*.npy")):
    rows = np.load(f)
    rows = rows[~np.isnan(rows[:, COLS.index("start")])]
    if not rows.size:
        continue
    c = {n: rows[:, i] for i, n in enumerate(COLS)}
    tl = timeline(rows)
    e2e = tl["e2e"]
    p45, p55, p99 = np.percentile(e2e, (45, 55, 99))
    slow, mid = e2e >= p99, (e2e >= p45) & (e2e <= p55)
    print(f"## {f.stem}: {len(e2e)} calls, p50 {np.median(e2e) * 1e6:,.0f} us, p99 "
          f"{p99 * 1e6:,.0f}, mean {e2e.mean() * 1e6:,.0f}")
    t1 = c["t1"]
    o = np.argsort(t1)
    cs = np.concatenate([[0.0], np.cumsum(e2e[o])])
    for w in (0.5e-3, 2e-3):
        lo, hi = np.searchsorted(t1[o], t1 - w), np.searchsorted(t1[o], t1 + w)
        nb = (cs[hi] - cs[lo]) / np.maximum(hi - lo, 1)
        print(f"neighbours ending within {w * 1e3:.1f} ms, their mean round trip: around the "
              f"slowest 1% {nb[slow].mean() * 1e6:,.0f} us, around p45-p55 "
              f"{nb[mid].mean() * 1e6:,.0f}")
    pid = c["pid"].astype(int)
    same = np.zeros(len(e2e))  # within 1 ms: its own front end's calls, then the others'
    other = np.zeros(len(e2e))
    for i in np.flatnonzero(slow | mid):
        near = np.abs(t1 - t1[i]) <= 1e-3
        near[i] = False
        s = near & (pid == pid[i])
        same[i] = e2e[s].mean() if s.any() else np.nan
        other[i] = e2e[near & ~s].mean() if (near & ~s).any() else np.nan
    print(f"within 1 ms, its own front end's calls / the other front ends' calls, mean round "
          f"trip: around the slowest 1% {np.nanmean(same[slow]) * 1e6:,.0f} / "
          f"{np.nanmean(other[slow]) * 1e6:,.0f} us, around p45-p55 "
          f"{np.nanmean(same[mid]) * 1e6:,.0f} / {np.nanmean(other[mid]) * 1e6:,.0f}")
    b = ((t1 - t1.min()) / 0.01).astype(int)
    nw = b.max() + 1
    wm = np.bincount(b, e2e, nw) / np.maximum(np.bincount(b, None, nw), 1)
    worst = np.argsort(wm)[-max(1, nw // 10):]
    print(f"10 ms windows: {nw}, their mean round trip p10 / p50 / p90 "
          f"{np.percentile(wm, 10) * 1e6:,.0f} / {np.percentile(wm, 50) * 1e6:,.0f} / "
          f"{np.percentile(wm, 90) * 1e6:,.0f} us; the slowest 1% in the worst tenth "
          f"{np.isin(b[slow], worst).mean():.2f}")
    cal = c["caller"].astype(int)
    _, n = np.unique(cal[slow], return_counts=True)
    print(f"callers {len(np.unique(cal))}, {len(n)} with a call in the slowest 1%, the 5 with "
          f"most hold {np.sort(n)[-5:].sum() / max(slow.sum(), 1):.2f} of them")
    # rounds: a device batch = the calls answered with one device_seconds (one MatmulReply)
    key = np.round(c["device_s"] * 1e9).astype(np.int64)
    bk, inv = np.unique(key, return_inverse=True)
    bt = np.full(len(bk), np.inf)
    np.minimum.at(bt, inv, c["read"])
    bt.sort()
    before = np.searchsorted(bt, c["read"]) - np.searchsorted(bt, c["sent"])
    held = np.zeros(len(e2e))
    for p in np.unique(pid):
        m = pid == p
        reads = np.unique(c["read"][m])
        held[m] = np.searchsorted(reads, c["sent"][m]) - np.searchsorted(reads, c["in"][m])
    print(f"device batches {len(bk)} ({len(e2e) / max(len(bk), 1):.1f} calls each)")
    for name, m in (("p45-p55", mid), ("slowest 1%", slow)):
        h = np.bincount(np.clip(before[m], 0, 5).astype(int), minlength=6)[:6] / m.sum()
        print(f"{name}: device batches answered between its hand-off and its answer "
              f"{before[m].mean():.2f} (0..5+: {' '.join(f'{v:.2f}' for v in h)}); its front "
              f"end's stacks answered while it waited in its stack {held[m].mean():.2f}")
    big = np.argmax(np.stack([tl[p][slow] for p in PARTS]), 0)
    print("slowest 1%, the largest part: " + ", ".join(
        f"{p} {np.mean(big == i):.2f}" for i, p in enumerate(PARTS) if np.any(big == i)))
    print("parts p50 / p99 / the slowest 1%'s mean (us): " + "; ".join(
        f"{p} {np.percentile(tl[p], 50) * 1e6:,.0f} / {np.percentile(tl[p], 99) * 1e6:,.0f} / "
        f"{tl[p][slow].mean() * 1e6:,.0f}" for p in PARTS))
    t00 = rows[:, 1].min()
    us = rows.copy()
    us[:, [1, 2, *range(7, rows.shape[1])]] -= t00
    keep[f.stem] = np.round(us * 1e6).astype(np.int64).clip(-2**31, 2**31 - 1).astype(np.int32)
if keep:  # the calls in us (seconds columns too): caller, t0, t1, queue, device_s, rows, pid, ...
    np.savez_compressed(sys.argv[2], cols=np.array(COLS), **keep)
EOF
  archive 2>/dev/null
}
lane() {  # lane RUN: the check's LANE=1 row (gpu_dataplane_lane.sh's F=2 C=1 J=1 P=0)
  Q6SERVE_JOB_BATCHES=1 Q6SERVE_PIPELINE_SHORT=0 Q6SERVE_DP_STATS=$OUT/dpstats_$1.jsonl \
    timeout "$(bound 20 1)" python3 bench/frontend_cpu.py --backend "$BACKEND" --rows $ROWS \
    --k $K --n 64 --lane --frontends 2 --hosts "${HOSTS:-8}" --callers 1 \
    --seconds "${SECONDS_PER_RUN:-1.5}" --warmup 0.5 --json "$OUT/$1.json" >"$OUT/$1.log" 2>&1
  note "# $1 (lane row) rc=$? at $(elapsed)"
  archive 2>/dev/null
}
t3() {  # t3 RUN: bench/service.py's T3 over system regions, 6 front ends round robin
  Q6SERVE_FRONTEND_ROUND_ROBIN=1 Q6SERVE_DP_STATS=$OUT/dpstats_$1.jsonl timeout "$(bound 16 1)" \
    python3 bench/service.py --backend "$BACKEND" --dataplane --modes stream --frontends 6 \
    --t3-hosts "${HOSTS:-8}" --seconds "${SECONDS_PER_RUN:-1.5}" --warmup 0.3 --targets T3 \
    --regions system --json "$OUT/$1.json" >"$OUT/$1.log" 2>&1
  note "# $1 (T3 system regions) rc=$? at $(elapsed)"
  archive 2>/dev/null
}
case $PHASE in
  a)
    # shellcheck disable=SC2086  # (run names)
    ab_runs 30 timeline ${TL_FIRST-f6}
    for r in ${RUNS-lane}; do
      if left "${NEED:-12}"; then "$r" "${r}_a"; else note "# ${r}_a skipped at $(elapsed)"; fi
    done
    # shellcheck disable=SC2086  # (run names)
    ab_runs 30 timeline ${TL_LAST-f8}
    ;;
  b)
    # shellcheck disable=SC2086  # (run names)
    TL_RUNS=${TL_RUNS:-1} ab_runs "${NEED:-20}" timeline ${TL_VARIANTS-f6 f8 f8 f6}
    ;;
  *) echo "PHASE=$PHASE: not a phase of this script" >&2; exit 2 ;;
esac
{
  echo "# phase $PHASE"
  for f in "$OUT"/f[0-9]*_[0-9].log; do  # (ab_runs' RUN: NAME_ROUND)
    [[ -f $f ]] && { echo "## ${f##*/}"; grep -h -A5 "^run " "$f" | cut -c1-200; }
  done
  for f in "$OUT"/f[0-9]*_[0-9].tail; do
    [[ -f $f ]] && { echo "## ${f##*/}"; cut -c1-260 "$f"; }
  done
  echo "# device process (Q6SERVE_DP_STATS, the busiest second), then its stages a call"
  python3 bench/device_stats_table.py "$OUT" --stages 2>&1
  for f in "$OUT"/t3_*.log; do
    [[ -f $f ]] && echo "# ${f##*/} $(grep -h -m1 -A1 "^T3 fe=" "$f" | cut -c1-150 | tr -s ' ')"
  done
  for f in "$OUT"/lane_*.log; do
    [[ -f $f ]] || continue
    echo "# ${f##*/} $(grep -h -A1 "lane load" "$f" | cut -c1-300 | tr -s ' ')"
    grep -h "cpu (cores" "$f" | cut -c1-160 || true
  done
  true  # (a log with no such line: the table still ends the script with status 0)
} | table
