"""bench/sk_ab.py's CPU parts (session 29): the variant labels, the source it compiles (the
stream-K tile of bench/ab/q6k_wgmma_sk.cu with q6k_wgmma.cu inlined and the variant's
#defines) and, where nvcc is, that every instantiation it launches builds for sm_90a, so a
broken kernel fails here rather than in a bundle's device time."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import sk_ab  # noqa: E402

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
    for bad in ("sk3", "wg0", "sk0.s3", "sk2.s4", "sk1.w4", "sk0.x1", "sk0.d5"):
        with pytest.raises(SystemExit):
            sk_ab.parse_variant(bad)


def test_source_inlines_the_wgmma_file() -> None:
    text = sk_ab.sk_text(sk_ab.parse_variant("sk1.s5"))
    assert text.startswith("#define Q6SERVE_SK_STAGES 5\n#define Q6SERVE_SK_DU 2\n")
    assert sk_ab.INC not in text and "q6k_wg_f16" in text and "q6k_wgsk_f16" in text
    assert '#include "' not in text  # everything inlined: NVRTC gets no include path


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("label", ["sk0", "sk1", "sk2", "sk2.d3.nofix.nomma.nodeq"])
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
