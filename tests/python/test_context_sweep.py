"""bench/context_sweep.py on made-up benchmark output: which rows it takes, its ratios, and the sections it writes
into the method pages (only between their markers)."""
import json
import pathlib
import re
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
STEP = "pdl:1/between:0/P:1/sort:{sort}/alpha:0"
PAGES = {"quest.md": ["quest", "oracle"], "ctkvr.md": ["ctkvr"], "csattention.md": ["csattention"],
         "a2ats.md": ["a2ats-union", "a2ats-group-max"], "centroidkv.md": ["centroidkv"], "specontext.md": ["specontext"]}


def bench_row(name, us):
    return {"run_name": name + "/min_time:0.100/manual_time", "run_type": "iteration", "real_time": us}


def run_sweep(tmp_path, rows, sdpa):
    (tmp_path / "sweep.json").write_text(json.dumps({"benchmarks": rows}))
    (tmp_path / "sdpa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sdpa))
    docs = tmp_path / "docs"
    docs.mkdir()
    for page, markers in PAGES.items():
        body = "".join(f"<!-- context-sweep-{m}:begin -->\nold rows\n<!-- context-sweep-{m}:end -->\n" for m in markers)
        (docs / page).write_text(f"# {page}\n\nbefore\n\n{body}\nafter\n")
    subprocess.run([sys.executable, str(ROOT / "bench" / "context_sweep.py"), "--gpu", "Test GPU", "--pages", str(docs),
                    str(tmp_path / "sweep"), str(tmp_path / "sdpa.jsonl"), str(tmp_path / "sweep.json")], check=True)
    return (tmp_path / "sweep.md").read_text(), {p: (docs / p).read_text() for p in PAGES}


def section(text, marker):
    return re.search(f"<!-- context-sweep-{marker}:begin -->\n(.*?)<!-- context-sweep-{marker}:end -->", text, re.S)[1]


def test_rows_ratios_and_page_sections(tmp_path, rng):
    n, batch = 131072, 1
    cudnn, quest, csa, csa_sorted, union, group_max, spec = (float(x) for x in rng.uniform(20, 900, 7).round(1))
    rows = [bench_row(f"BM_Step/method:0/N:{n}/batch:{batch}/" + STEP.format(sort=0), quest),
            bench_row(f"BM_Step/method:3/N:{n}/batch:{batch}/" + STEP.format(sort=0), csa),
            bench_row(f"BM_Step/method:3/N:{n}/batch:{batch}/" + STEP.format(sort=1), csa_sorted),  # not the default
            bench_row(f"BM_Step/method:4/N:{n}/batch:{batch}/" + STEP.format(sort=0), union),
            bench_row(f"BM_Step/method:4/N:{n}/batch:{batch}/" + STEP.format(sort=1), group_max),
            bench_row(f"BM_SpeContextStep/mode:0/N:{n}/batch:{batch}/pdl:1/between:0", spec),
            bench_row(f"BM_SpeContextStep/mode:1/N:{n}/batch:{batch}/pdl:1/between:0", 1.0)]  # dense: not a series
    table, pages = run_sweep(tmp_path, rows, [{"backend": "cudnn", "N": n, "batch": batch, "graph_us": cudnn},
                                              {"backend": "flash", "N": n, "batch": batch, "graph_us": 1.0}])

    line = next(l for l in table.splitlines() if l.startswith("| 128K | 1 |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[2] == f"{cudnn:.1f} µs" and cells[3] == "—"  # cuDNN, and no dense decode row given
    assert cells[4] == f"{quest:.1f} µs ({cudnn / quest:.2f}×)"
    assert cells[7] == f"{csa:.1f} µs ({cudnn / csa:.2f}×)"  # the dense reduction, not sort:1
    assert cells[8] == f"{union:.1f} µs ({cudnn / union:.2f}×)"
    assert cells[9] == f"{group_max:.1f} µs ({cudnn / group_max:.2f}×)"
    assert cells[11] == f"{spec:.1f} µs ({32 * cudnn / spec:.2f}×)"  # 32 layers against 32 times cuDNN
    assert cells[5] == cells[6] == cells[10] == "—"

    assert f"| 128K | 1 | {spec:.1f} µs | {32 * cudnn:.1f} µs | {32 * cudnn / spec:.2f}× |" in section(
        pages["specontext.md"], "specontext")
    assert f"| 128K | 1 | {group_max:.1f} µs | {cudnn:.1f} µs | {cudnn / group_max:.2f}× |" in section(
        pages["a2ats.md"], "a2ats-group-max")
    assert f"{union:.1f} µs" in section(pages["a2ats.md"], "a2ats-union")
    assert section(pages["ctkvr.md"], "ctkvr").startswith("Not in this run")
    # Each section's plot, named from the page: the prefix's per-selector SVG.
    assert "](../sweep_specontext.svg)" in section(pages["specontext.md"], "specontext")
    assert "](../sweep_a2ats-group-max.svg)" in section(pages["a2ats.md"], "a2ats-group-max")
    if shutil.which("gnuplot"):
        assert all((tmp_path / f"sweep_{m}.svg").stat().st_size > 0 for ms in PAGES.values() for m in ms)
    for page, markers in PAGES.items():
        text = pages[page]
        assert text.startswith(f"# {page}\n\nbefore\n") and text.endswith("\nafter\n") and "old rows" not in text
        assert all(text.count(f"context-sweep-{m}:begin") == 1 for m in markers)

    dat = (tmp_path / "sweep.dat").read_text().splitlines()
    values = next(l for l in dat if l.startswith(f"{n} ")).split()
    assert float(values[-1]) == round(spec / 32, 2)  # the plot's SpeContext is per layer
