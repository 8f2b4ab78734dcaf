"""benchmarks/grammar_costs.py runs as documented on the default model's tokenizer: each spec
asked for gets a row with its compile time and a walk that its masks allowed."""

from __future__ import annotations

import pytest

from tests.support.benchmark_scripts import import_scripts

(grammar_costs,) = import_scripts("grammar_costs")


def test_each_spec_asked_for_compiles_and_walks(default_model_dir, capsys):
    specs = ["json_object", "1 string, maxLength 12"]
    options = ["--rows", "2", "--steps", "40", "--model-path", str(default_model_dir)]
    assert grammar_costs.main(options + [f"--spec={spec}" for spec in specs]) == 0
    _, header, _, *rows = capsys.readouterr().out.splitlines()
    assert header.startswith("| spec | compile | steps |")
    cells = [row.strip("| ").split(" | ") for row in rows]
    assert [cell[0] for cell in cells] == specs
    # A 12-character string closes its object within 40 tokens; the free object does not.
    assert int(cells[0][2]) == 40 and 0 < int(cells[1][2]) < 40


def test_a_spec_it_does_not_know_is_refused(capsys):
    with pytest.raises(SystemExit):
        grammar_costs.main(["--spec", "no such spec"])
    assert "invalid choice" in capsys.readouterr().err
