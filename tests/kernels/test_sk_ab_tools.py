"""bench/sk_ab.py's CPU parts (session 29): the variant labels, the source it compiles (the
stream-K tile of bench/ab/q6k_wgmma_sk.cu with q6k_wgmma.cu inlined and the variant's
#defines) and, where nvcc is, that every instantiation it launches builds for sm_90a, so a
broken kernel fails here rather than in a bundle's device time; and (session 30) that ptxas
keeps stream-K v2's wgmma groups in flight across units, where cuobjdump is to read its SASS."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import sk_ab  # noqa: E402

sys.path.insert(0, str(ROOT / "bench" / "ab"))
import sass_same  # noqa: E402

NVCC = next((p for p in ("nvcc", "/usr/local/cuda/bin/nvcc")
             if subprocess.run(["which", p], capture_output=True).returncode == 0
             or Path(p).exists()), None)


def test_variant_labels() -> None:
    assert sk_ab.parse_variant("sk0") == {"label": "sk0", "xb": 0, "nwg": 3, "stages": 4,
                                          "du": 2, "probes": []}
    assert sk_ab.parse_variant("sk2.nofix.nomma")["probes"] == ["NOFIX", "NOMMA"]
    v = sk_ab.parse_variant("sk1.w2.s5.d4")
    assert (v["xb"], v["nwg"], v["stages"], v["du"]) == (1, 2, 5, 4)
    assert sk_ab.parse_variant("sk2")["stages"] == 6  # the mbarrier ring: two units of slack
    assert sk_ab.parse_variant("sk3") == {"label": "sk3", "xb": 3, "nwg": 3, "stages": 6,
                                          "du": 2, "probes": []}
    assert sk_ab.parse_variant("sk3.w2.nofix")["probes"] == ["NOFIX"]
    for bad in ("sk4", "wg0", "sk0.s3", "sk2.s4", "sk3.s4", "sk1.w4", "sk0.x1", "sk0.d5",
                "sk3.nomma", "sk3.nodeq"):
        with pytest.raises(SystemExit):
            sk_ab.parse_variant(bad)


def test_source_inlines_the_wgmma_file() -> None:
    text = sk_ab.sk_text(sk_ab.parse_variant("sk1.s5"))
    assert text.startswith("#define Q6SERVE_SK_STAGES 5\n#define Q6SERVE_SK_DU 2\n")
    assert sk_ab.INC not in text and "q6k_wg_f16" in text and "q6k_wgsk_f16" in text
    assert '#include "' not in text  # everything inlined: NVRTC gets no include path


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("label", ["sk0", "sk1", "sk2", "sk2.d3.nofix.nomma.nodeq", "sk3"])
def test_instantiations_build_for_sm90a(tmp_path, label) -> None:
    src = tmp_path / "sk.cu"
    src.write_text("#define Q6SERVE_SK_CHECK\n" + sk_ab.sk_text(sk_ab.parse_variant(label)))
    res = subprocess.run([NVCC, "-arch=sm_90a", "-cubin", "-Xptxas", "-v", "-o",
                          str(tmp_path / "sk.cubin"), str(src)], capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    # ptxas serializes every wgmma of a kernel where one may be in flight across a divergent
    # path (C7518): bundles A-C of session 29 ran so (Q6SERVE_SK_DRAIN 0 fails here)
    out = res.stdout + res.stderr
    assert "wgsk_f16" in out and "serialized" not in out, out[-3000:]
    if label != "sk3":
        return
    # stream-K v2: every build, no spills; where cuobjdump is, its SASS keeps two wgmma groups
    # in flight across units (a wait for 2 after each of a unit's 16 wgmmas and a wait for 0
    # only at a segment's end; sk2 drains every unit: two waits for 0, the serialized form
    # 16)
    built = re.findall(r"Compiling entry function '(_Z13q6k_wgsk3_f16\w+)'", out)
    assert len(built) == 8, out[-3000:]
    assert not re.search(r"wgsk3[^\n]*\n[^\n]*[1-9]\d* bytes spill stores", out), out[-3000:]
    cuobjdump = sass_same.find_cuobjdump()
    if cuobjdump is None:
        return
    dump = sass_same.dump(tmp_path / "sk.cubin", cuobjdump)
    for name in built:
        sass = dump.sass[name]
        assert sass.count("HGMMA.") == 16, name
        assert len(re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x2", sass)) == 16, name
        assert len(re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x0", sass)) == 1, name
    sk2 = [k for k in dump.sass if k.startswith("_Z12q6k_wgsk_f16ILi8ELi2ELi3ELi2E")]
    assert sk2 and len(re.findall(r"DEPBAR\.LE gsb0, 0x0", dump.sass[sk2[0]])) == 2


def _sk_schedule(rows: int, k: int, nwg: int, grid: int) -> dict:
    """The stream-K tiles' schedule as q6k_wgsk_f16 / q6k_wgsk3_f16 compute it (row groups of
    nwg 64-row tiles x K blocks, CTA c's run [U c / G, U (c + 1) / G), its row groups last-first,
    owner = the CTA holding a row group's last unit, nlow = the CTAs below it with units of that
    row group): {c: [(rg, a, e, owner, nlow)]}."""
    bpr = k // 256
    rgroups = -(-((rows + 63) // 64) // nwg)
    units = rgroups * bpr
    g = min(grid, units)
    out = {}
    for c in range(g):
        u0, u1 = units * c // g, units * (c + 1) // g
        segs, rg = [], (u1 - 1) // bpr
        while True:
            a, e = max(u0, rg * bpr) - rg * bpr, min(u1, rg * bpr + bpr) - rg * bpr
            owner = rg < (u1 - 1) // bpr or u1 == rg * bpr + bpr
            nlow = 0
            while c - 1 - nlow >= 0 and units * (c - nlow) // g > rg * bpr:
                nlow += 1
            segs.append((rg, a, e, owner, nlow if owner and a > 0 else 0))
            if rg <= u0 // bpr:
                break
            rg -= 1
        out[c] = segs
    return out


@pytest.mark.parametrize(("rows", "k", "nwg"), [
    (18944, 3584, 3), (14336, 4096, 3), (3584, 18944, 3), (4096, 14336, 2), (300, 2304, 3),
    (33, 9472, 3), (1000, 512, 3), (64, 1024, 3), (152064, 3584, 3), (3584, 3584, 2)])
def test_stream_k_schedule_covers_every_unit_once_with_one_partial_per_cta(rows, k, nwg):
    """The fix-up's invariants sk3 keeps from sk2 (its owner and nlow loops, written again):
    every (row group, K block) unit in exactly one CTA; one owner a row group, whose nlow CTAs
    below are exactly the other CTAs with units of it; each of those holds it as its first
    segment (the partial is written at the CTA's start, before it could wait on anyone) and
    writes at most one partial (one workspace slot a CTA)."""
    sched = _sk_schedule(rows, k, nwg, 132)
    seen: dict = {}
    for c, segs in sched.items():
        assert sum(1 for s in segs if not s[3]) <= 1
        assert all(s[3] for s in segs[1:])  # only the first segment may be a partial
        for rg, a, e, _owner, _nlow in segs:
            for kb in range(a, e):
                assert (rg, kb) not in seen
                seen[(rg, kb)] = c
    bpr = k // 256
    rgroups = -(-((rows + 63) // 64) // nwg)
    assert len(seen) == rgroups * bpr
    for rg in range(rgroups):
        holders = sorted({c for (r, _), c in seen.items() if r == rg})
        owners = [(c, s) for c in holders for s in sched[c] if s[0] == rg and s[3]]
        assert len(owners) == 1
        c, (_, a, _, _, nlow) = owners[0]
        assert c == holders[-1] and nlow == len(holders) - 1 and (a > 0) == (nlow > 0)
        assert holders == list(range(c - nlow, c + 1))
