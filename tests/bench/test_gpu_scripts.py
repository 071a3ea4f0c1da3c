"""Every bench/gpu_*.sh device script, rehearsed on the CPU: a script that no longer runs fails
here, not in a device call of the lead's bundle.

Each script runs as the device would run it (from the tree's root, ``DRY_RUN=1``: gpu_lib.sh's
rehearsal, no install), with ``timeout`` stood in for by a stub that records the command it was
given instead of running it (every timed command of these scripts runs under ``timeout``; a
bench/*.sh command is run, so a script's nested script is rehearsed too). The rest runs: the
script's control flow, gpu_lib.sh's functions, the tables printed from the (empty) logs. Then
each recorded command is checked against the tree: the files it names exist, a bench/*.py or
``q6serve`` command's ``--options`` are in its ``--help``, pytest's test paths exist. No timing.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import stat
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p.name for p in (ROOT / "bench").glob("gpu_*.sh") if p.name != "gpu_lib.sh")

# a script's rehearsals: (id, environment, arguments); a script not named here runs once with none
GPU_RUN_MODES = ("kstest wgtest retune envab tune wall tests bench record variants probe tile "
                 "ncu stalls kstall")
RUNS: dict[str, list[tuple[str, dict[str, str], list[str]]]] = {
    "gpu_check.sh": [
        ("full", {"LANE": "1", "KERNELS_LAST": "30", "DP_VARIANTS": "4 6rr",
                  "AWAKE_REPLAY": "1"}, []),
        ("closing", {"SKIP_PINNED": "1", "SKIP_TRIPS": "1", "SKIP_PROBES": "1", "WALL": "1",
                     "DP_VARIANTS": "6rr"}, []),
        ("tests_only", {"TESTS_ONLY": "1", "WALL": "1"}, []),
        ("targets_only", {"SKIP_SUITES": "1", "SKIP_PINNED": "1", "SKIP_TRIPS": "1",
                          "SKIP_PROBES": "1", "REPLAY_SEQS": "8", "DP_VARIANTS": "6rr"}, []),
        ("replay_stamps", {"SKIP_DATAPLANE": "1", "REPLAY_STAMPS": "1",
                           "REPLAY_SPINS": "0,1000"}, []),
    ],
    # every mode but `ab`, which installs a second tree ($AB_BASE) with pip
    "gpu_run.sh": [("modes", {"SKIP_INSTALL": "1", "BUNDLE": "1",
                              "ENVAB_ENV": "Q6SERVE_X=1"}, GPU_RUN_MODES.split())],
    "gpu_dataplane_run.sh": [("variants", {"VARIANTS": "4 8@200 8:0 8:m0 6rr"}, [])],
    "gpu_hp_s30.sh": [("a", {"PHASE": "a"}, []), ("b", {"PHASE": "b"}, [])],
    "gpu_t1_s30.sh": [("a", {"PHASE": "a"}, []), ("b", {"PHASE": "b"}, [])],
    "gpu_k_s30.sh": [("a", {"PHASE": "a"}, []), ("b", {"PHASE": "b"}, []),
                     ("c", {"PHASE": "c", "BOUND": "60"}, [])],
    "gpu_dp_s30.sh": [("a", {"PHASE": "a"}, []), ("b", {"PHASE": "b"}, [])],
}
# what a shell prints when a script is broken (a bad name, an unset variable, a parse error)
BROKEN = re.compile(r"command not found|unbound variable|syntax error|"
                    r"invalid time interval|bad substitution|ambiguous redirect")

TIMEOUT_STUB = """\
#!{python}
# stands in for coreutils' timeout: records the command (bench/test_gpu_scripts.py) and runs it
# only if it is a bench/*.sh script, also behind `env [-u NAME] [VAR=VALUE...]` (so that its
# own timed commands are recorded too)
import json, os, subprocess, sys
args = sys.argv[1:]
while args[0].startswith("-"):  # timeout's own options
    if args.pop(0) in ("-k", "-s", "--kill-after", "--signal"):
        args.pop(0)
limit, cmd = args[0], args[1:]
with open(os.environ["STUB_LOG"], "a") as f:
    f.write(json.dumps({{"cwd": os.getcwd(), "limit": limit, "argv": cmd}}) + "\\n")
if (nap := float(os.environ.get("STUB_SLEEP", "0"))):  # a command that takes this long
    import time
    time.sleep(min(nap, float(limit)))
    if nap > float(limit):
        sys.exit(124)  # as timeout says a command it killed
i = 1 if cmd[0] == "env" else 0
while i and i < len(cmd) and (cmd[i].startswith("-") or "=" in cmd[i]):
    i += 2 if cmd[i] in ("-u", "--unset") else 1
sys.exit(subprocess.call(cmd) if cmd[i].endswith(".sh") else 0)
"""


def _stub_bin(tmp: Path) -> Path:
    """A folder for PATH's front: timeout (above), python3 (this venv's), nvidia-smi and ncu
    (CI machines have neither; gpu_run.sh calls them outside timeout)."""
    d = tmp / "bin"
    d.mkdir()
    stubs = {
        "timeout": TIMEOUT_STUB.format(python=sys.executable),
        "python3": f'#!/bin/sh\nexec "{sys.executable}" "$@"\n',
        "nvidia-smi": "#!/bin/sh\necho 'no GPU (rehearsal)'\n",
        "ncu": "#!/bin/sh\nexit 0\n",
    }
    for name, text in stubs.items():
        (d / name).write_text(text)
        (d / name).chmod(stat.S_IRWXU)
    return d


@cache
def _help(cmd: tuple[str, ...]) -> str:
    """The --help text of a command (a bench script, or ``-m q6serve.client.cli SUB``)."""
    done = subprocess.run([sys.executable, *cmd, "--help"], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)
    assert done.returncode == 0, (cmd, done.stderr[-2000:])
    return done.stdout


def _with_help(cwd: Path, argv: list[str]) -> tuple[tuple[str, ...], list[str]] | None:
    """A recorded ``python3 ...`` command (argv without python3) whose options its --help
    lists: (the command to ask, its arguments); None for another kind."""
    if argv[:2] == ["-m", "q6serve.client.cli"]:
        return ("-m", "q6serve.client.cli", argv[2]), argv[3:]
    if argv and argv[0].endswith(".py") and (cwd / argv[0]).exists():
        return (str((cwd / argv[0]).resolve()),), argv[1:]
    return None


def _python_problems(cwd: Path, argv: list[str]) -> list[str]:
    """What is wrong with one recorded ``python3 ...`` command (argv without python3)."""
    if argv[:2] == ["-m", "pytest"]:
        paths = [a.split("::")[0] for a in argv[2:] if a.startswith("tests/")]
        return [f"no test path {p}" for p in paths if not (cwd / p).exists()] or (
            [] if paths else ["pytest without a test path"])
    if argv and argv[0].endswith(".py") and not (cwd / argv[0]).exists():
        return [f"no script {argv[0]} (from {cwd})"]
    if (got := _with_help(cwd, argv)) is None:
        return []  # (python3 -c / -m other: nothing to check against)
    cmd, args = got
    text = _help(cmd)
    return [f"{' '.join(cmd)}: no option {o}" for o in {a.split("=")[0] for a in args
            if a.startswith("--")} if not re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", text)]


def _command(rec: dict) -> tuple[Path, list[str], list[str]]:
    """A recorded command's working folder and argv with `env` and `ncu` taken off, and what
    is wrong with its timeout."""
    argv, cwd = list(rec["argv"]), Path(rec["cwd"])
    bad = [] if float(rec["limit"]) > 0 else [f"timeout {rec['limit']!r}"]
    while argv and argv[0] == "env":  # env [-C DIR] [-u NAME] [VAR=VALUE...] CMD
        argv.pop(0)
        while argv and (argv[0].startswith("-") or "=" in argv[0]):
            opt = argv.pop(0)
            if opt in ("-C", "--chdir"):
                cwd = cwd / argv.pop(0)
            elif opt in ("-u", "--unset"):
                argv.pop(0)
    if argv and argv[0] == "ncu":  # ncu [options] python3 ...: the profiled command
        argv = argv[next((i for i, a in enumerate(argv) if a in ("python3", "python")), len(argv)):]
    return cwd, argv, bad


def _problems(rec: dict) -> list[str]:
    """What is wrong with one command the stub recorded."""
    cwd, argv, bad = _command(rec)
    if not argv:
        return [*bad, f"no command: {rec['argv']}"]
    if argv[0] in ("python3", "python"):
        return bad + _python_problems(cwd, argv[1:])
    if argv[0].endswith(".sh") and not (cwd / argv[0]).exists():
        return [*bad, f"no script {argv[0]}"]
    return bad


def _cases() -> list:
    return [pytest.param(s, env, args, id=f"{s}-{rid}")
            for s in SCRIPTS for rid, env, args in RUNS.get(s, [("default", {}, [])])]


@pytest.mark.parametrize(("script", "env", "args"), _cases())
def test_gpu_script_rehearsal(tmp_path: Path, script: str, env: dict[str, str],
                              args: list[str]) -> None:
    out, log = tmp_path / "out", tmp_path / "commands.jsonl"
    run_env = {**os.environ, **env, "DRY_RUN": "1", "OUT": str(out), "STUB_LOG": str(log),
               "PATH": f"{_stub_bin(tmp_path)}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(["bash", f"bench/{script}", *args], cwd=ROOT, env=run_env,
                          capture_output=True, text=True, timeout=120)
    said = done.stdout + done.stderr
    assert done.returncode == 0, said[-3000:]
    assert not BROKEN.search(said), said[-3000:]
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    assert recs, f"{script} ran no timed command:\n{said[-2000:]}"
    asks = {got[0] for cwd, argv, _ in map(_command, recs)
            if argv[:1] == ["python3"] and (got := _with_help(cwd, argv[1:]))}
    with ThreadPoolExecutor(4) as pool:  # (each --help is a second of imports: once each)
        list(pool.map(_help, asks))
    bad = [p for rec in recs for p in _problems(rec)]
    assert not bad, "\n".join(bad + [shlex.join(r["argv"]) for r in recs])
    if "gpu_lib.sh" in (ROOT / "bench" / script).read_text():  # gpu_session's: logs come back
        assert [p for p in out.iterdir() if p.name != "dry"], "nothing in $FINAL"


LIB_SCRIPT = """
source bench/gpu_lib.sh
gpu_session /tmp/libtest
show() { echo "$1 $2 x=${Q6SERVE_X:-} f=${FRONTENDS:-} pp=${PYTHONPATH:-}"; }
PYTHONPATH=/now BASEPP=/base
ab_runs 0 show a b:Q6SERVE_X=1,FRONTENDS=6 b:Q6SERVE_X=1,FRONTENDS=6 a base4:Q6SERVE_X=2
echo "after x=${Q6SERVE_X:-unset} f=${FRONTENDS:-unset} pp=$PYTHONPATH"
BOUND=1000 T0=$(($(date +%s) - 900))  # 100 s left (99 if the clock ticks meanwhile)
echo "bound $(bound 30) $(bound 300) $(bound 300 40)"
left 50 && echo "left 50"
left 200 || echo "not left 200"
ab_runs 200 show c
step ok 30 true
step three 30 sh -c 'echo last line; exit 3'
echo "rc $?"
T0=$(($(date +%s) - 2000))
step late 30 true
echo "rc $?"
steps
echo table line | table
"""


def test_gpu_lib_functions(tmp_path: Path) -> None:
    """gpu_lib.sh's rules: ab_runs' rounds, variables (local to a run) and base tree; bound,
    left and step against the bundle's bound; step's status lines; table and archive."""
    out = tmp_path / "out"
    done = subprocess.run(["bash", "-c", "set -uo pipefail\n" + LIB_SCRIPT], cwd=ROOT,
                          env={**os.environ, "DRY_RUN": "1", "OUT": str(out)},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and not done.stderr, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[:6] == [
        "a_1 a x= f= pp=/now",
        "b_1 b x=1 f=6 pp=/now",
        "b_2 b x=1 f=6 pp=/now",
        "a_2 a x= f= pp=/now",
        "base4_1 base4 x=2 f= pp=/base",
        "after x=unset f=unset pp=/now",
    ]
    assert re.fullmatch(r"bound 30 (100|99) (60|59)", lines[6]), lines[6]
    assert lines[7:9] == ["left 50", "not left 200"]
    assert re.fullmatch(r"# c_1 skipped at 9\d\d s \(bound 1000 s\)", lines[9]), lines[9]
    assert [x.rsplit(" at ", 1)[0] for x in lines[10:15]] == [
        "# ok rc=0", "# three rc=3", "rc 3", "# late rc=124", "rc 124"]
    assert [x.split() for x in lines[15:18]] == [
        ["ok", "rc=0"], ["three", "rc=3", "last", "line"],
        ["late", "rc=124", "skipped:", *lines[17].split()[3:]]]
    assert lines[18:] == ["table line"]
    assert (out / "summary.txt").read_text() == "table line\n"
    assert (out / "libtest.tgz").exists()
    assert re.search(r"^late +rc=124 +skipped", (out / "progress.txt").read_text(), re.M)


def test_machine_watch_samples_and_ends_with_the_script(tmp_path: Path) -> None:
    """gpu_lib.sh's machine_watch: one line a second (busy, iowait, steal %, load, MHz, GPU
    clock: '-' without nvidia-smi) and the processes first seen, summarised by
    machine_summary; the sampler ends within a second or two of the shell that started it."""
    out = tmp_path / "out"
    out.mkdir()
    script = ('source bench/gpu_lib.sh\nOUT=$1\nmachine_watch\necho "pid $!"\n'
              'sleep 3.5\nmachine_summary\n')
    done = subprocess.run(["bash", "-c", script, "bash", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PATH": f"{_stub_bin(tmp_path)}{os.pathsep}"
                               f"{os.environ['PATH']}"})
    assert done.returncode == 0 and not done.stderr, done.stdout + done.stderr
    pid = int(done.stdout.split()[1])
    summary = re.search(r"# machine: (\d+) s sampled, busy max \d+%, steal max \d+% mean "
                        r"[\d.]+%, mean MHz \S+", done.stdout)
    assert summary and int(summary[1]) >= 2, done.stdout
    assert "# ps " in done.stdout
    rows = [line.split() for line in (out / "machine.log").read_text().splitlines()
            if not line.startswith("#")]
    assert len(rows) >= 2 and all(len(r) == 9 for r in rows), rows
    assert all(0 <= int(r[1]) <= 100 and 0 <= int(r[3]) <= 100 for r in rows), rows
    import time

    for _ in range(40):  # the shell is gone: the sampler follows within its next second
        if not Path(f"/proc/{pid}").exists():
            break
        time.sleep(0.1)
    assert not Path(f"/proc/{pid}").exists(), "machine_watch outlived its script"


def test_gpu_check_order_and_bound(tmp_path: Path) -> None:
    """bench/gpu_check.sh as the closing check runs it, on a slow host: the targets' steps run
    before any test suite, each cut to what is left of BOUND; what does not fit is skipped, and
    the targets table still comes last, its rows "cut" (not "not run") for those steps."""
    out, log = tmp_path / "out", tmp_path / "commands.jsonl"
    env = {**os.environ, "DRY_RUN": "1", "OUT": str(out), "STUB_LOG": str(log),
           "PATH": f"{_stub_bin(tmp_path)}{os.pathsep}{os.environ['PATH']}",
           "SKIP_PINNED": "1", "SKIP_TRIPS": "1", "SKIP_PROBES": "1", "DP_VARIANTS": "6rr",
           "BOUND": "7", "RESERVE": "1", "STUB_SLEEP": "2.5"}
    done = subprocess.run(["bash", "bench/gpu_check.sh"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    steps = [line.split("\t") for line in
             (out / "dry/tmp/check/steps.tsv").read_text().splitlines()]
    names = [s[0] for s in steps]
    suites = ["demo", "launch_gpu", "service_cuda", "dataplane_gpu", "kernels_gpu"]
    assert names == ["t1", "wall", "kernel_ref", "replay", "lm_head", "lm_head_fe4",
                     "lm_head_nospin", "t1_again", "dataplane_f6_rr", *suites], names
    # 7 s less 1 s of reserve: t1 takes 2.5 s; wall gets 3-4 s (2 on a loaded host: then it is
    # cut at 2), kernel_ref what is left (cut at it, or skipped); everything after is skipped
    # (each step takes at least its 2.5 s or its whole limit: no second left by the replay)
    how = {s[0]: (s[1], s[3], s[4]) for s in steps}
    assert how["t1"] == ("0", "6", "ran") and how["wall"][2] in ("ran", "cut"), how
    assert how["kernel_ref"][2] in ("cut", "skipped"), how
    assert all(how[n][:3:2] == ("124", "skipped") for n in names[3:]), how
    said = done.stdout.rstrip().splitlines()
    table = said[said.index("| target | figure | limit | result |"):]
    assert said[-1] == table[-1] and said[-1].startswith("| q6serve demo"), said[-5:]
    got = {c[0]: c[-1] for c in ([x.strip() for x in line.strip("|").split("|")]
                                 for line in table[2:])}
    assert got["replay S=8 step p50, multi / single (the target)"] == "cut"
    assert got["T2 / T3 (data plane)"] == "cut"
    assert got["GPU tests, tests/kernels"] == "cut"
    assert got["T1, p50 - kernel (N=1 f16 ffn_down, stream)"] == "no figure"  # (a rehearsal)
