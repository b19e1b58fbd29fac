"""bench_goodput's README table is computed from the measured levels (numbers and the summary line)."""

import pytest

from benchmarks.bench_goodput import main, markdown


def _lv(ds, c, ar, gp, plain):
    return {"dataset": ds, "c": c, "ar": {"tokens_per_s": ar}, "fixed B=4": {"tokens_per_s": ar / 2},
            "goodput": {"tokens_per_s": gp, "plain_round_fraction": plain}, "goodput_vs_best": gp / ar}


def test_markdown_table_rows_and_summary():
    res = {"levels": [_lv("gsm8k", 1, 20.0, 19.0, 0.99), _lv("gsm8k", 4, 40.0, 40.0, 1.0),
                      _lv("mt-bench", 1, 10.0, 9.0, 0.5)]}
    md = markdown(res).splitlines()
    assert md[0].startswith("| dataset | c | ar tok/s | fixed B=4 tok/s | goodput tok/s |")
    assert md[2] == "| gsm8k | 1 / 4 | 20.0 / 40.0 | 10.0 / 20.0 | 19.0 / 40.0 | 99.0 % / 100.0 % | 0.95 / 1.00 |"
    assert md[3] == "| mt-bench | 1 | 10.0 | 5.0 | 9.0 | 50.0 % | 0.90 |"
    assert md[-1] == "goodput / max(ar, best fixed): mean 0.950, min 0.900, 1 of 3 points >= 0.97"


def test_markdown_calibration_column():
    res = {"levels": [_lv("gsm8k", 1, 20.0, 19.0, 0.99), _lv("gsm8k", 4, 40.0, 40.0, 1.0)]}
    res["levels"][0]["calibration B=8"] = {"tokens_per_s": 12.0, "calib_tau_error_per_request": 0.0123}
    res["levels"][1]["calibration B=8"] = {"tokens_per_s": 15.0, "calib_tau_error_per_request": None}
    md = markdown(res).splitlines()
    assert md[0].endswith("| calibration B=8: per-request \\|mean predicted − mean realised τ\\| |")
    assert md[2].endswith("| 0.95 / 1.00 | 0.012 / – |")
    assert md[2].count("|") == md[0].count("|") - 2  # the header's escaped pipes are not columns


@pytest.mark.parametrize("argv", [["--repeats", "0"], ["--calibration-budget", "0"], ["--calibration-budget", "-2"]])
def test_bad_counts_are_argparse_errors_before_loading(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and "must be >= 1" in capsys.readouterr().err
