"""The demo, run as a user runs it: its table says what the README promises."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from PIL import Image

from lossweight.demo import SPLITS, run_demo


def test_the_demo_shows_naive_splits_differ_and_lossweight_splits_agree(tmp_path: Path) -> None:
    png = tmp_path / "curves.png"
    printed = subprocess.run(
        [sys.executable, "-m", "lossweight.demo", "--steps", "3", "--output", str(png)],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    ).stdout
    rows = re.findall(r"│ (.+?) +│ (naive|lossweight) +│ +(\S+) │ +(\S+) │", printed)
    table = {
        (split.strip(), method): (float(diff), float(loss)) for split, method, diff, loss in rows
    }
    assert set(table) == {(split, m) for split in SPLITS for m in ("naive", "lossweight")}

    reference_loss = table[("1 x 1", "lossweight")][1]
    for split in SPLITS:
        diff, loss = table[(split, "lossweight")]
        assert diff < 1e-5  # float32 round-off
        assert loss == reference_loss
        if split != "1 x 1":  # one microbatch has nothing to weight
            assert table[(split, "naive")][0] > 0.1

    assert f"Plot written to {png.resolve()}" in printed.replace("\n", "")
    with Image.open(png) as image:
        assert image.format == "PNG" and image.size[0] > 500 and image.size[1] > 300
        image.verify()

    # The same seed gives the same numbers in this process as in the command's.
    runs = run_demo(steps=3, seed=0)
    for run in runs:
        diff, loss = table[(run.split, run.method)]
        assert f"{run.eval_loss:.4f}" == f"{loss:.4f}"
        assert f"{run.gradient_difference:.1e}" == f"{diff:.1e}"


def test_no_plot_writes_nothing(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "lossweight.demo", "--steps", "1", "--no-plot"],
        check=True,
        capture_output=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert list(tmp_path.iterdir()) == []


def test_a_missing_plotting_library_is_named_before_any_training() -> None:
    hide = "import sys; sys.modules['matplotlib'] = None; import runpy; "
    run = "runpy.run_module('lossweight.demo', run_name='__main__')"
    finished = subprocess.run(
        [sys.executable, "-c", hide + run, "--steps", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert finished.returncode == 2
    assert finished.stdout == ""  # nothing trained, nothing printed
    assert "the demo needs matplotlib, which is not installed" in finished.stderr
    assert 'pip install "lossweight[demo]", or run it with --no-plot' in finished.stderr
