#!/usr/bin/env bash
# One GPU session for the kernel work: install the carried wheels and the project, run the GPU
# tests and the kernel benchmark, and leave every log under $OUT (the device tool fetches it).
#   bench/gpu_run.sh [MODE...]  MODE: kstest|wgtest|ab|retune|envab|tests|bench|variants|record|probe|stalls|kstall|tune|wall|tile|ncu|all|none
#   (several modes after one install; extra bench args in $BENCH_ARGS)
# Order: kstest, wgtest, ab, retune, envab, tune, wall, tests, the rest.
# ab: bench/kernels.py $AB_ARGS in the tree at $AB_BASE, then in this one (AUTO side by side).
# kstall: Nsight Compute stall metrics of the K-slice/wgmma kernel on PROFILE_SHAPE per row of
#       KSTALL_ROWS ("N:" AUTO's kernel at N, "N:TEXT" the --variants row whose label has TEXT).
# tune: bench/kernels.py --tune writes kernels/cuda/dispatch_h200.json (copied to $OUT), so
#       modes after it run with the new table. retune: the table A/B on one machine: AUTO with
#       the committed table ($RETUNE_ARGS, default f16, no torch), tune (torch beside AUTO),
#       AUTO with the new table, side by side (retune.txt); then the modes after it.
# wall: bench/backend_wall.py (host path). envab: bench/kernels.py $ENVAB_ARGS without, with
#       and again without the environment $ENVAB_ENV (e.g. an experiment's switch; ENVAB_RUNS
#       "off on" skips the repeat), then the rows whose label has $ENVAB_MATCH side by side
#       (envab.txt; the repeat bounds the drift).
# record: every path and launch variant and torch's f16 linear, ending with an AUTO-vs-best
#         summary (bench/RESULTS.md). probe: bench/probe_memory.py (memory-side ceilings) and
#         Nsight Compute on the AUTO tile. stalls: Nsight Compute stall breakdown of the rows
#         named in PROFILE_ROWS ("SHAPE:N:LABEL-TEXT ...").
# SKIP_INSTALL=1: the wheels and the project are installed already (an earlier invocation).
# BUNDLE=1: every log into $OUT/logs.tgz at the end (the device tool returns 8 files at most).
# kstest: the K-slice tiles' GPU tests (KSTEST_ARGS: more pytest arguments, e.g. -k). wgtest: the wgmma tile's (sm_90). tile: bench/tile_probe.py (TILE_ARGS): the K-slice
#       tiles checked and timed on the model shapes. ncu: Nsight Compute (NCU_SET, default full)
#       of AUTO, the heuristic f16 tile and the K-slice tiles on NCU_SHAPE at NCU_NS
#       (bench/tile_probe.py --profile: one launch each), report + text under $OUT.
set -uo pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
MODES=" ${*:-all} "
want() { [[ $MODES == *" $1 "* ]]; }
if [[ -n ${SKIP_INSTALL:-} ]]; then  # a second invocation in the same device call
  [[ -d /tmp/site ]] && export PYTHONPATH=/tmp/site
else
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
  fi
  python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
    || { cat "$OUT/install.log"; exit 1; }
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu \
  --format=csv >"$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
# the tree's commit: the sender's COMMIT file where there is one (a copied tree's .git may be
# another checkout's: session 27's check wrote session 26's commit here), else git's
if [[ -f COMMIT ]]; then echo "commit $(cat COMMIT) (the sender's COMMIT file)"
else git log -1 --format='commit %H %s' 2>/dev/null; fi | tee "$OUT/commit.txt"
rc=0
if want kstest; then  # the K-slice tile's GPU tests, before a tune may put it in the table
  # shellcheck disable=SC2086
  timeout "${KSTEST_TIMEOUT:-200}" python3 -m pytest -m gpu -q -rfE --maxfail=5 -p no:cacheprovider \
    ${KSTEST_ARGS:-} tests/kernels/test_cuda_ks.py 2>&1 | tee "$OUT/pytest_ks.log" | tail -15
  rc=${PIPESTATUS[0]}
fi
if want wgtest; then  # the wgmma tile's GPU tests (sm_90 only), before a tune may pick it
  timeout "${WGTEST_TIMEOUT:-200}" python3 -m pytest -m gpu -q -rfE --maxfail=5 -p no:cacheprovider \
    tests/kernels/test_cuda_wg.py 2>&1 | tee "$OUT/pytest_wg.log" | tail -15
  [[ ${PIPESTATUS[0]} == 0 ]] || rc=1
fi
if want ab; then  # AUTO of the tree at $AB_BASE (a copy of another commit) vs this tree, same table
  # rows; before tune (which rewrites this tree's table). AB_ARGS: bench/kernels.py arguments.
  # shellcheck disable=SC2086
  (cd "$AB_BASE" && python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/ab_install.log" 2>&1 \
    && timeout "${AB_TIMEOUT:-120}" python3 bench/kernels.py ${AB_ARGS:-} --json "$OUT/ab_base.json" >"$OUT/ab_base.log" 2>&1)
  echo "# ab base rc=$?"
  python3 -m pip install -q --no-deps --no-build-isolation -e . >>"$OUT/ab_install.log" 2>&1 || exit 1
  # shellcheck disable=SC2086
  timeout "${AB_TIMEOUT:-120}" python3 bench/kernels.py ${AB_ARGS:-} --json "$OUT/ab_new.json" >"$OUT/ab_new.log" 2>&1
  echo "# ab new rc=$?"
  python3 bench/kernels_ab.py "$OUT/ab_base.json" "$OUT/ab_new.json" --label-old base --label-new this \
    | tee "$OUT/ab.txt"
fi
tune_run() {  # bench/kernels.py --tune: rewrites this tree's table, copied to $OUT
  # shellcheck disable=SC2086
  timeout "${TUNE_TIMEOUT:-240}" python3 bench/kernels.py --tune --iters "${TUNE_ITERS:-20}" \
    --commit "${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}" ${TUNE_ARGS:-} \
    --json "$OUT/tune.json" 2>&1 | tee "$OUT/tune.log" | grep -v "^$" | tail -100
  echo "# tune rc=${PIPESTATUS[0]}"
  cp kernels/cuda/dispatch_h200.json "$OUT/" 2>/dev/null
}
if want retune; then  # AUTO with the committed table, tune, AUTO with the new one (same machine)
  args=${RETUNE_ARGS:---paths auto --dtypes f16 --no-torch}
  # shellcheck disable=SC2086
  timeout "${AB_TIMEOUT:-120}" python3 bench/kernels.py $args --json "$OUT/retune_old.json" \
    >"$OUT/retune_old.log" 2>&1
  echo "# retune old rc=$?"
  tune_run
  # shellcheck disable=SC2086
  timeout "${AB_TIMEOUT:-120}" python3 bench/kernels.py $args --json "$OUT/retune_new.json" \
    >"$OUT/retune_new.log" 2>&1
  echo "# retune new rc=$?"
  python3 bench/kernels_ab.py "$OUT/retune_old.json" "$OUT/retune_new.json" --label-old table \
    --label-new retuned | tee "$OUT/retune.txt"
fi
if want envab; then  # one tree, with and without an environment switch, same machine
  for v in ${ENVAB_RUNS:-off on off2}; do
    # shellcheck disable=SC2086
    ( [[ $v == on ]] && export ${ENVAB_ENV:?}; timeout "${AB_TIMEOUT:-120}" python3 bench/kernels.py \
      ${ENVAB_ARGS:-} --json "$OUT/envab_$v.json" >"$OUT/envab_$v.log" 2>&1 )
    echo "# envab $v rc=$?"
  done
  for v in on off2; do
    [[ -f $OUT/envab_$v.json ]] || continue
    python3 bench/kernels_ab.py "$OUT/envab_off.json" "$OUT/envab_$v.json" --label-old off \
      --label-new "$v" --match "${ENVAB_MATCH:-mma_f16}"
  done | tee "$OUT/envab.txt"
fi
if want tune; then  # before the tests: they run with the table it writes
  tune_run
fi
if want wall; then
  # shellcheck disable=SC2086
  timeout "${WALL_TIMEOUT:-120}" python3 bench/backend_wall.py ${WALL_ARGS:-} \
    --json "$OUT/wall.json" 2>&1 | tee "$OUT/wall.log" | tail -60
fi
if want tests || want all; then
  timeout "${TEST_TIMEOUT:-360}" python3 -m pytest -m gpu -q -rfE --maxfail=20 -p no:cacheprovider \
    tests/kernels/test_cuda_backend.py tests/kernels/test_epilogue.py 2>&1 \
    | tee "$OUT/pytest_gpu.log" | tail -40
  rc=${PIPESTATUS[0]}
fi
if want bench || want all; then
  # shellcheck disable=SC2086
  timeout "${BENCH_TIMEOUT:-300}" python3 bench/kernels.py ${BENCH_ARGS:-} --json "$OUT/bench.json" \
    2>&1 | tee "$OUT/bench.log" | grep -v "^$" | tail -120
fi
if want record; then  # every path, every launch variant, torch, in one run
  # shellcheck disable=SC2086
  timeout "${BENCH_TIMEOUT:-300}" python3 bench/kernels.py --variants --summary ${BENCH_ARGS:-} \
    --json "$OUT/record.json" 2>&1 | tee "$OUT/record.log" | grep -v "^$" | tail -200
fi
if want variants; then
  # shellcheck disable=SC2086
  timeout "${BENCH_TIMEOUT:-300}" python3 bench/kernels.py --variants --no-torch \
    --paths auto,exact,mmq_q8_1 ${BENCH_ARGS:-} --json "$OUT/variants.json" 2>&1 \
    | tee "$OUT/variants.log" | grep -v "^$" | tail -150
fi
if want probe; then  # memory-side ceiling + Nsight Compute on the AUTO tile
  timeout 200 python3 bench/probe_memory.py --json "$OUT/probe.json" >"$OUT/probe.log" 2>&1
  echo "# probe rc=$?"
  for n in ${PROBE_NS-1 8 64}; do
    timeout 120 ncu --clock-control none -k regex:"${PROBE_KERNEL:-q6k_mma}" --launch-skip 6 \
      --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis \
      --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
      python3 bench/kernels.py --shapes "${PROBE_SHAPE:-4096x14336}" --ns "$n" --paths auto \
      --no-torch >"$OUT/ncu_n$n.txt" 2>&1
    echo "# ncu N=$n rc=$?"
    grep -E "Duration|DRAM Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Theoretical Occ|Block Limit|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Grid Size|Waves Per" \
      "$OUT/ncu_n$n.txt" | head -24
  done
  sed -n '/^# best/,$p' "$OUT/probe.log"
fi
if want tile; then
  # shellcheck disable=SC2086
  timeout "${TILE_TIMEOUT:-200}" python3 bench/tile_probe.py ${TILE_ARGS:-} \
    --json "$OUT/tile_probe.json" 2>&1 | tee "$OUT/tile_probe.log" | sed -n '/^# us/,$p'
fi
if want ncu; then
  # shellcheck disable=SC2086
  timeout "${NCU_TIMEOUT:-200}" ncu --clock-control none --set "${NCU_SET:-full}" \
    -k "regex:${NCU_KERNELS:-q6k_mma|q6k_ks|q6k_wg}" -o "$OUT/ncu" -f python3 bench/tile_probe.py \
    --profile --no-torch --shapes "${NCU_SHAPE:-4096x14336}" --ns "${NCU_NS:-16,64}" \
    >"$OUT/ncu_run.log" 2>&1
  echo "# ncu rc=$?"; grep -E "^# profile|ERR|rror" "$OUT/ncu_run.log" | head
  ncu --import "$OUT/ncu.ncu-rep" --page details >"$OUT/ncu_details.txt" 2>&1
  grep -E "q6k_|Duration|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Block Limit (Reg|Shared)|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Grid Size|Shared Memory Configuration Size|Local Memory Spilling|Bank Conflicts|L2 Hit Rate|Executed Ipc A" \
    "$OUT/ncu_details.txt" | grep -v "^ *-" | head -120
  ncu --import "$OUT/ncu.ncu-rep" --page raw --csv --metrics \
    gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,smsp__inst_executed.avg.per_cycle_active,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active \
    >"$OUT/ncu_stalls.csv" 2>&1; cut -c1-400 "$OUT/ncu_stalls.csv" | head -12
fi
if want stalls; then  # Nsight Compute stall breakdown of chosen rows (PROFILE_ROWS)
  m=smsp__average_warps_issue_stalled
  metrics=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed
  metrics+=,smsp__inst_executed.avg.per_cycle_active,sm__warps_active.avg.pct_of_peak_sustained_active
  metrics+=,sm__inst_executed.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum
  for r in long_scoreboard short_scoreboard mio_throttle math_pipe_throttle barrier wait \
      not_selected selected no_instruction dispatch_stall lg_throttle drain branch_resolving \
      imc_miss misc sleeping tex_throttle membar; do metrics+=",${m}_${r}_per_issue_active.ratio"; done
  i=0
  for row in ${PROFILE_ROWS:-152064x3584:1:auto=}; do
    IFS=: read -r shape n only <<<"$row"
    timeout 150 ncu --clock-control none --launch-skip 6 --launch-count 1 -k regex:q6k_mma \
      --metrics "$metrics" python3 bench/kernels.py --shapes "$shape" --ns "$n" --paths auto \
      --variants --only "$only" --no-torch >"$OUT/stalls$i.txt" 2>&1
    echo "# $row rc=$?"; grep -E "q6k_mma|duration|dram__|per_cycle|warps_active|inst_executed.sum|bank|stalled" "$OUT/stalls$i.txt" | sed -E 's/smsp__average_warps_issue_stalled_//; s/_per_issue_active.ratio//' | awk '{$1=$1};1' | grep -vE " 0(\.0+)?$" | head -30
    i=$((i + 1))
  done
fi
if want kstall; then  # Nsight Compute stall metrics of AUTO's K-slice/wgmma kernel per N
  m=smsp__average_warps_issue_stalled
  metrics=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed
  metrics+=,smsp__inst_executed.avg.per_cycle_active,sm__warps_active.avg.pct_of_peak_sustained_active
  metrics+=,smsp__issue_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread
  metrics+=,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active
  metrics+=,l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum
  for r in long_scoreboard short_scoreboard mio_throttle math_pipe_throttle barrier wait \
      not_selected dispatch_stall lg_throttle; do metrics+=",${m}_${r}_per_issue_active.ratio"; done
  i=0
  for row in ${KSTALL_ROWS:-16: 32: 64:}; do
    n=${row%%:*} only=${row#*:}
    sel=(--paths auto)
    [[ -n $only ]] && sel=(--paths auto --variants --only "$only")
    timeout 90 ncu --clock-control none --launch-skip 4 --launch-count 1 -k "regex:q6k_(ks|wg)_f16" \
      --metrics "$metrics" python3 bench/kernels.py --shapes "${PROFILE_SHAPE:-4096x14336}" --ns "$n" \
      "${sel[@]}" --dtypes f16 --no-torch --iters 4 >"$OUT/kstall$i.txt" 2>&1
    echo "# kstall $row rc=$?"
    grep -E "q6k_|duration|dram__|per_cycle|warps_active|issue_active|registers|hmma|local|stalled" \
      "$OUT/kstall$i.txt" | sed -E 's/smsp__average_warps_issue_stalled_//; s/_per_issue_active.ratio//' \
      | awk '{$1=$1};1' | cut -c1-110 | head -24
    i=$((i + 1))
  done
fi
if [[ -n ${BUNDLE:-} ]]; then  # the device tool returns at most 8 files: one archive of the logs
  (cd "$OUT" && tar czf logs.tgz --exclude=logs.tgz --exclude='*.ncu-rep' -- * \
    && find . -maxdepth 1 -type f ! -name logs.tgz ! -name dispatch_h200.json ! -name tune.log ! -name retune.txt \
       ! -name '*.ncu-rep' -delete)
fi
exit "$rc"
