"""GPU names (issue 11 item 11): no "closest" GPU of another architecture, new catalog entries, old GPUs by SM."""

from __future__ import annotations

import pytest

from precision_pipeline.core.errors import UserError
from precision_pipeline.spec.hardware import ARCH_BY_SM, CATALOG, gpus_with_sm, resolve_gpu

KNOWN = "known GPUs: " + ", ".join(CATALOG) + "."


def refusal(name):
    with pytest.raises(UserError) as ei:
        resolve_gpu(name)
    assert len(ei.value.problems) == 1
    pr = ei.value.problems[0]
    assert pr.field == "target.gpu"
    return pr


# ---------------------------------------------------------------------------------------------
# the three reported answers


def test_rtx_a6000_is_ampere_sm86_not_blackwell():
    g = resolve_gpu("RTX A6000")
    assert (g.id, g.sm, g.arch) == ("rtx-a6000", 86, "Ampere")
    assert resolve_gpu("NVIDIA RTX A6000").id == resolve_gpu("rtxa6000").id == resolve_gpu("a6000").id == "rtx-a6000"


@pytest.mark.parametrize("name,vendor", [
    ("mi300x", "AMD"), ("AMD Instinct MI250", "AMD"), ("MI355X", "AMD"), ("Radeon RX 7900 XTX", "AMD"),
    ("Gaudi 3", "Intel"), ("Intel Data Center GPU Max 1550", "Intel"), ("TPU v5e", "Google TPU"),
    ("trn1", "AWS Trainium/Inferentia"), ("Trainium2", "AWS Trainium/Inferentia"), ("inf2", "AWS Trainium/Inferentia"),
])
def test_other_vendors_are_not_nvidia(name, vendor):
    pr = refusal(name)
    assert pr.rule == "gpu.known"
    assert pr.reason == (f"{name!r} is not an NVIDIA GPU ({vendor}); "
                         "TensorRT-LLM runs on NVIDIA GPUs with SM >= 80.")
    assert pr.fix == f"plan for an NVIDIA GPU; {KNOWN}"


def test_cyrillic_lookalike_is_refused_naming_the_character():
    pr = refusal("\u04bb100")  # Cyrillic small shha, looks like 'h'
    assert pr.rule == "gpu.known"
    assert pr.reason == ("unknown GPU '\u04bb100': it contains '\u04bb' (U+04BB CYRILLIC SMALL LETTER SHHA), a "
                         "non-ASCII character (it may only look like a Latin letter or digit); GPU names are plain ASCII.")
    # the ASCII reading is the same GPU the user meant (never v100, as the old difflib fallback said)
    assert pr.fix == f"retype the name in ASCII; typed in ASCII it reads 'h100' (h100-sxm); {KNOWN}"
    assert "v100" not in pr.fix.split("known GPUs:")[0]


def test_non_ascii_without_an_ascii_reading():
    pr = refusal("h100\u2603")
    assert pr.reason.startswith("unknown GPU 'h100\u2603': it contains '\u2603' (U+2603 SNOWMAN)")
    assert pr.fix == f"retype the name in ASCII; {KNOWN}"


# ---------------------------------------------------------------------------------------------
# a suggestion is a typing slip of one GPU, never another architecture


@pytest.mark.parametrize("name,gid", [
    ("h10O", "h100-sxm"), ("h1OO", "h100-sxm"), ("h10", "h100-sxm"), ("a100-80bg", "a100-80gb"),
    ("a100 80gbb", "a100-80gb"), ("l4o", "l40"), ("h100-smx", "h100-sxm"), ("rtx-a600", "rtx-a6000"),
    ("b20O", "b200"),
])
def test_typo_suggests_the_same_gpu(name, gid):
    pr = refusal(name)
    assert pr.rule == "gpu.known" and pr.reason == f"unknown GPU {name!r}."
    assert pr.fix == f"the closest known GPU is {gid!r}; {KNOWN}"


def test_a100_80g_is_an_alias():
    assert resolve_gpu("a100-80g").id == "a100-80gb"


@pytest.mark.parametrize("name", [
    "b100",       # a Blackwell part not in the catalog: not the Hopper h100
    "a1000",      # the RTX A1000 (SM 86): not the SM 80 A100
    "x100", "100", "h1", "6000", "blackwell", "hopper", "rtx", "gpu", "nvidia", "l30", "a100-48gb",
])
def test_no_suggestion_across_products(name):
    pr = refusal(name)
    assert pr.rule == "gpu.known" and pr.reason == f"unknown GPU {name!r}."
    assert pr.fix == KNOWN


@pytest.mark.parametrize("n", ["4", "5", "6"])
def test_rtx_n000_is_ambiguous(n):
    name = f"RTX {n}000"
    pr = refusal(name)
    assert pr.rule == "gpu.known" and pr.reason == f"unknown GPU {name!r}."
    assert pr.fix == (f"'RTX {n}000' names GPUs of three architectures: rtx-{n}000-ada (RTX {n}000 Ada, SM 89), "
                      f"rtx-a{n}000 (RTX A{n}000, Ampere SM 86) and Quadro RTX {n}000 (Turing SM 75, not supported by "
                      f"TensorRT-LLM 1.x); give the full name; {KNOWN}")
    assert resolve_gpu(f"RTX {n}000 Ada").sm == 89 and resolve_gpu(f"RTX A{n}000").sm == 86


def test_long_name_is_not_quoted_whole():
    pr = refusal("h" * 6000)
    assert pr.reason == f"unknown GPU {'h' * 64!r}... (6,000 characters)."
    assert len(pr.render()) < 1200


# ---------------------------------------------------------------------------------------------
# old NVIDIA GPUs: refused by name with their SM


@pytest.mark.parametrize("name,product,sm", [
    ("P100", "Tesla P100", 60), ("Tesla P100-PCIE-16GB", "Tesla P100", 60), ("p40", "Tesla P40", 61),
    ("Tesla P4", "Tesla P4", 61), ("K80", "Tesla K80", 37), ("Tesla M60", "Tesla M60", 52),
    ("M40", "Tesla M40", 52), ("GeForce GTX 1080 Ti", "GeForce GTX 10xx", 61), ("gtx1070", "GeForce GTX 10xx", 61),
    ("1080 ti", "GeForce GTX 10xx", 61), ("RTX 2080 Ti", "GeForce RTX 20xx", 75),
    ("NVIDIA GeForce RTX 2070 SUPER", "GeForce RTX 20xx", 75), ("GTX 1660 Ti", "GeForce GTX 16xx", 75),
    ("Quadro RTX 6000", "Quadro RTX 6000", 75), ("Quadro RTX 8000", "Quadro RTX 8000", 75),
    ("TITAN RTX", "TITAN RTX", 75), ("Titan V", "TITAN V", 70),
])
def test_old_gpu_refused_with_its_sm(name, product, sm):
    pr = refusal(name)
    assert pr.rule == "gpu.supported"
    assert pr.reason == (f"{name!r} ({product}) is SM {sm} ({ARCH_BY_SM[sm]}); TensorRT-LLM 1.x supports SM >= 80 "
                         "only (Ampere, Ada, Hopper, Blackwell).")
    assert pr.fix == "use an Ampere or newer GPU, e.g. a100-80gb, l4, h100-sxm."


def test_old_gpus_stay_out_of_sm_listings():
    ids = {g.id for g in gpus_with_sm([(0, 10**6)])}
    assert ids == set(CATALOG)
    assert {g.id for g in gpus_with_sm([(0, 79)])} == {"v100", "t4"}


# ---------------------------------------------------------------------------------------------
# new catalog entries: SM, format availability, the datasheet figures


@pytest.mark.parametrize("name,gid,sm", [
    ("RTX A5000", "rtx-a5000", 86), ("RTX A4000", "rtx-a4000", 86), ("A40", "a40", 86), ("A30", "a30", 80),
    ("A16", "a16", 86), ("A2", "a2", 86), ("L40", "l40", 89), ("L20", "l20", 89), ("H20", "h20", 90),
    ("H800", "h800-sxm", 90), ("H800 PCIe", "h800-pcie", 90), ("A800", "a800-80gb", 80),
    ("A800 40GB", "a800-40gb", 80), ("NVIDIA GeForce RTX 3090", "rtx-3090", 86), ("RTX 3090 Ti", "rtx-3090-ti", 86),
    ("RTX 5000 Ada", "rtx-5000-ada", 89), ("RTX 4500 Ada Generation", "rtx-4500-ada", 89),
    ("RTX 4000 Ada", "rtx-4000-ada", 89), ("H200 NVL", "h200-nvl", 90), ("DGX Spark", "gb10", 121),
    ("GB10", "gb10", 121), ("Jetson AGX Orin", "jetson-agx-orin", 87),
])
def test_new_names_resolve(name, gid, sm):
    g = resolve_gpu(name)
    assert (g.id, g.sm) == (gid, sm)


@pytest.mark.parametrize("gid,mem_gb,bw,bf16,fp8,fp4", [
    ("rtx-a6000", 48, 768, 154.8, None, None), ("rtx-a5000", 24, 768, 111.1, None, None),
    ("rtx-a4000", 16, 448, 76.7, None, None), ("a40", 48, 696, 149.7, None, None), ("a30", 24, 933, 165, None, None),
    ("a16", 16, 200, 35.9, None, None), ("a2", 16, 200, 18, None, None), ("a800-80gb", 80, 2039, 312, None, None),
    ("rtx-3090", 24, 936, 71, None, None), ("l40", 48, 864, 181.05, 362, None), ("l20", 48, 864, 119.5, 239, None),
    ("rtx-5000-ada", 32, 576, 261.1, 522.2, None), ("h800-sxm", 80, 3350, 989.4, 1978.9, None),
    ("h20", 96, 4000, 148, 296, None), ("h200-nvl", 141, 4800, 835.5, 1670.5, None), ("gb10", 128, 273, 125, 250, 500),
])
def test_new_entry_figures(gid, mem_gb, bw, bf16, fp8, fp4):
    g = CATALOG[gid]
    assert (g.memory_gb, g.bandwidth_gbs, g.bf16_tflops, g.fp8_tflops, g.fp4_tflops) == (mem_gb, bw, bf16, fp8, fp4)


@pytest.mark.parametrize("gid", ["l20", "h20", "h800-sxm", "rtx-3090-ti", "jetson-agx-orin", "gb10"])
def test_unconfirmed_figures_are_flagged(gid):
    assert "unverified" in CATALOG[gid].note.lower()


def test_existing_ids_and_aliases_unchanged():
    for name, gid in [("h100", "h100-sxm"), ("a100", "a100-80gb"), ("rtx-pro-6000", "rtx-pro-6000-blackwell"),
                      ("gb300", "b300"), ("4090", "rtx-4090"), ("grace-hopper", "gh200"), ("v100-16gb", "v100")]:
        assert resolve_gpu(name).id == gid
