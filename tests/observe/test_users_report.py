"""Plots and comparisons a user reads: one logged point is visible, a flat series is not blown up, steps
are integers, and `accel-train compare` says how the runs differ in world size and global batch and can line
them up on samples seen."""

import pytest
import toy_train
from conftest import reset_accelerate

from accel_train.cli import main as cli
from accel_train.observe.report.plots import Panel, Series, line_plot, read_series, series_by_label

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_single_point_is_drawn_with_a_marker(tmp_path):
    path = line_plot(tmp_path / "p.png", [Panel("loss", [Series("train loss", [4], [0.7]),
                                                         Series("eval loss", [2, 4], [0.9, 0.8], "--")])], "loss")
    styles = {s["label"]: s["style"] for s in read_series(path)["panels"][0]["series"]}
    assert styles["train loss"].startswith("o"), "one logged point is a marker (a line through one point is invisible)"
    assert styles["eval loss"] == "--"  # two points: a line, as asked


def test_a_near_constant_series_gets_a_sensible_y_range(tmp_path):
    memory = [512.3, 512.35, 512.4, 512.4]
    path = line_plot(tmp_path / "m.png", [Panel("peak memory (MiB)", [Series("rss", [1, 2, 3, 4], memory)]),
                                          Panel("loss", [Series("loss", [1, 2, 3, 4], [2.0, 1.0, 0.5, 0.3])])], "t")
    memory_panel, loss_panel = read_series(path)["panels"]
    low, high = memory_panel["ylim"]
    assert low < 512.3 * 0.96 and high > 512.4 * 1.04 and low > 0, \
        f"a near-flat series is not blown up over the whole panel: ylim {low:.3f} .. {high:.3f}"
    assert loss_panel["ylim"][1] - loss_panel["ylim"][0] < 2.5  # a series that moves keeps matplotlib's range


def test_step_axes_have_integer_ticks(tmp_path):
    path = line_plot(tmp_path / "s.png", [Panel("loss", [Series("loss", [1, 2, 3], [1.0, 0.8, 0.7])])], "loss")
    ticks = read_series(path)["xticks"]
    assert ticks and all(float(t).is_integer() for t in ticks), f"step ticks are whole steps: {ticks}"


def run_toy(out, batch):
    reset_accelerate()
    toy_train.main(["--output_dir", str(out), "--report_to", "none", "--disable_tqdm", "--num_train_epochs", "1",
                    "--per_device_train_batch_size", str(batch), "--logging_steps", "2", "--save_strategy", "no",
                    "--run_report", "true"])
    return out


def test_compare_shows_world_size_and_global_batch_and_aligns_on_samples(tmp_path):
    small, large = run_toy(tmp_path / "b8", 8), run_toy(tmp_path / "b16", 16)
    assert cli(["compare", str(small), str(large), "-o", str(tmp_path / "cmp"), "--x", "samples"]) == 0
    text = (tmp_path / "cmp" / "compare.md").read_text()
    assert "| world_size | 1 | 1 |" in text and "| global_batch_size | 8 | 16 |" in text  # the setup, always
    differences = text[text.index("## Config differences"):]
    assert "| global_batch_size | 8 | 16 |" in differences and "| world_size |" not in differences
    plot = read_series(tmp_path / "cmp" / "loss.png")
    assert plot["xlabel"] == "samples seen"
    curves = series_by_label(tmp_path / "cmp" / "loss.png")
    assert curves["b8 train"]["x"][:2] == [16, 32] and curves["b16 train"]["x"][:2] == [32, 64]  # step x batch
    assert cli(["compare", str(small), str(large), "-o", str(tmp_path / "by_step")]) == 0
    assert series_by_label(tmp_path / "by_step" / "loss.png")["b16 train"]["x"][:2] == [2, 4]
