"""The scorecard (every number the paper prints beside ours, with a verdict) and Table 2 as the paper prints it: both
generated from the published result directories, checked like every table."""

import re
import shutil

import pytest

from conftest import ROOT
from lightning_maskprior.cli import main
from lightning_maskprior.run.rundir import ResultDir
from lightning_maskprior.study import scorecard
from lightning_maskprior.study.scorecard import CPU_SCALE, PAPER_SCALE, Cells, Ours, Results, Row, verdict

SCORECARD = ROOT / "docs/scorecard.md"


def test_the_scorecard_is_what_report_generates():
    """docs/scorecard.md, results/table2_as_printed.md and the README's summary are generated: none was edited by
    hand and none is behind its data files. After a new study run: `maskprior report --scorecard docs/scorecard.md
    --readme README.md`."""
    main(["report", "--check", "--scorecard", str(SCORECARD), "--readme", str(ROOT / "README.md")])


def test_the_scorecard_has_a_verdict_on_forty_numbers_and_counts_them():
    rows = scorecard.rows(Results(ROOT / "docs/results"))
    measured = [r for r in rows if r.ours is not None]
    assert len(measured) >= 40 and all(r.verdict != "not run" for r in measured)
    text = SCORECARD.read_text()
    for name, n in scorecard.counts(rows).items():
        assert f"| {name} | {n} |" in text
    assert len(re.findall(r"^\| \w+ \| [\w -]+ \| \w+ \| [\d.]+ \| [\d.e+-]+", text, re.M)) == len(measured)
    assert "- reproduces: " in (ROOT / "README.md").read_text() and "(docs/scorecard.md)" in \
        (ROOT / "README.md").read_text()


def test_table2_as_printed_has_every_cell_at_three_seeds():
    rows = scorecard.rows(Results(ROOT / "docs/results"))
    table2 = [r for r in rows if r.table == "2"]
    assert len(table2) == 24 and all(r.ours is not None and list(r.ours.values) == [0, 1, 2] for r in table2)
    page = (ROOT / "docs" / scorecard.TABLE2_PAGE).read_text()
    printed = page.split("## Ablations")[0]
    assert printed.count("| *paper* |") == 4 and "–" not in printed and "seeds)" not in printed


def _row(ours: list[float], paper: float, scale: str = PAPER_SCALE, method: str = "mask") -> Row:
    cells = Cells(scale, "study/x.yaml", "x.md")
    values = Ours(dict(enumerate(ours)), 2, "higher") if ours else None
    return Row("1", "2parity", method, "acc", paper, cells, values)


@pytest.mark.parametrize(("ours", "paper", "scale", "default", "expected"), [
    ([99.5, 99.9], 99.98, PAPER_SCALE, ([75.0], 75.0), "reproduces"),  # within 1 point
    ([69.0, 99.0, 70.0], 69.49, PAPER_SCALE, ([5.0], 5.0), "reproduces"),  # two of three seeds within 1 point
    ([40.0, 80.0], 69.49, PAPER_SCALE, ([5.0], 5.0), "same order"),  # the mean within twice the std, no seed within
    ([90.0], 99.98, PAPER_SCALE, ([75.0], 75.0), "same order"),  # off by 10 points, above the default as the paper
    ([99.9], 99.98, CPU_SCALE, ([75.0], 75.0), "same order"),  # at CPU scale nothing reproduces
    ([75.0], 99.98, PAPER_SCALE, ([75.0], 75.0), "differs"),  # level with the default where the paper is above it
    ([], 99.98, PAPER_SCALE, ([75.0], 75.0), "not run"),
])
def test_the_verdict_rule(ours, paper, scale, default, expected):
    row = _row(ours, paper, scale)
    base = _row(*default, scale=scale, method="default")
    assert verdict(row, [row, base]) == expected


def test_a_default_row_has_no_order():
    default = _row([60.0], 75.0, method="default")
    assert verdict(default, [default]) == "differs"
    spread = _row([65.71, 54.86, 25.96], 87.45, method="default")  # no seed near the paper, however wide the std
    assert verdict(spread, [spread]) == "differs"
    at_cpu_scale = _row([60.0], 75.0, CPU_SCALE, method="default")
    assert verdict(at_cpu_scale, [at_cpu_scale]) == "other scale"


def _published_copy(tmp_path):
    """The data files (study.json, results.csv) of the result directories the scorecard reads, in a docs/ folder."""
    names = {name for tasks in scorecard.SOURCES.values() for cells in tasks.values()
             for sources in cells.sources.values() for name, _, _ in sources}
    names |= {name for _, _, columns in scorecard.TABLE2_ABLATIONS for cells in columns.values()
              for sources in cells.sources.values() for name, _, _ in sources}
    for name in names:
        (tmp_path / "docs/results" / name).mkdir(parents=True)
        for data in (ResultDir.STUDY, ResultDir.RESULTS):
            shutil.copyfile(ROOT / "docs/results" / name / data, tmp_path / "docs/results" / name / data)
    return tmp_path / "docs/scorecard.md"


def test_check_fails_when_a_result_changes_and_the_scorecard_does_not(tmp_path, capsys):
    card = _published_copy(tmp_path)
    main(["report", "--scorecard", str(card)])
    main(["report", "--check", "--scorecard", str(card)])  # up to date: no exit
    results = tmp_path / "docs/results/boolean_paper" / ResultDir.RESULTS
    rows = results.read_text().splitlines()
    rows[1] = rows[1].replace(",ok,", ",failed,")  # a run of Table 1 fails when rerun
    results.write_text("\n".join(rows) + "\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["report", "--check", "--scorecard", str(card)])
    assert exit_info.value.code == 1 and str(card) in capsys.readouterr().err


def test_report_needs_a_result_dir_or_the_scorecard(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["report"])
    assert exit_info.value.code == 2 and "give a RESULT_DIR or --scorecard" in capsys.readouterr().err


@pytest.mark.parametrize(("mask", "others", "expected"), [
    (([99.0], 99.98), [([75.0], 75.0), ([80.0], 80.0)], "holds"),  # ahead of the best other in both
    (([80.5], 99.98), [([75.0], 75.0), ([80.0], 80.0)], "level here"),  # within 1 point of the best other here
    (([70.0], 99.98), [([75.0], 75.0), ([80.0], 80.0)], "does not hold here"),
    (([99.0], 70.0), [([75.0], 75.0)], "the paper's Mask is not ahead; here it is ahead"),
    (([], 99.98), [([75.0], 75.0)], "not run here"),
    (([99.0], 99.98), [([], 75.0)], "not run here"),  # nothing to compare with here
])
def test_the_claim_on_a_task(mask, others, expected):
    """The claim row: the Mask against the best other method, in the paper's numbers and in ours."""
    rows = [_row(*mask), *(_row(*o, method=m) for o, m in zip(others, ("default", "qk_opt"), strict=False))]
    ((_, paper, ours, claim),) = scorecard.claim_rows(rows)
    assert claim == expected
    assert paper.startswith(f"{mask[1]:.2f} / ")
    assert (ours == "–") == (claim == "not run here")


def test_the_scorecard_states_the_claim_task_by_task():
    rows = scorecard.rows(Results(ROOT / "docs/results"))
    text = SCORECARD.read_text()
    claimed = scorecard.claim_rows(rows)
    assert "## The claim, task by task" in text and f"holds here on {scorecard.claim_count(claimed)}" in text
    assert {m.task for m, *_ in claimed} >= {"2parity", "multiplication", "addition", "wikitext2"}
    assert f"holds here on {scorecard.claim_count(claimed)}" in (ROOT / "README.md").read_text()
