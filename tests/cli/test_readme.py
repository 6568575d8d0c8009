"""README.md opens with the train and test commands, and .ci/run runs the test command verbatim."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def bash_blocks(text):
    blocks, inside = [], False
    for line in text.splitlines():
        if line.strip() == "```bash":
            inside, current = True, []
        elif line.strip() == "```" and inside:
            inside = False
            blocks.append("\n".join(current))
        elif inside:
            current.append(line)
    return blocks


def test_readme_starts_with_train_then_test_command_and_ci_runs_the_test_command():
    train_cmd, test_cmd = bash_blocks((ROOT / "README.md").read_text())[:2]
    assert train_cmd.startswith("pip install") and train_cmd.endswith("nsa train")
    assert test_cmd.startswith("pip install") and "pytest" in test_cmd
    ci_lines = [l for l in (ROOT / ".ci" / "run").read_text().splitlines() if l and not l.startswith(("#", "set ", "cd "))]
    assert ci_lines == [test_cmd]


def test_the_readmes_bench_plot_example_redraws_a_file_an_earlier_line_writes():
    lines = [line.split("#")[0].split() for block in bash_blocks((ROOT / "README.md").read_text())
             for line in block.splitlines()]
    plots = [words for words in lines if words[:3] == ["nsa", "bench", "plot"]]
    assert plots
    for words in plots:
        results = Path(words[3])
        kind = results.stem  # attention, decode or train
        writers = [w for w in lines[:lines.index(words)] if w[:3] == ["nsa", "bench", kind] and "--out" in w]
        assert any(Path(w[w.index("--out") + 1]) == results.parent for w in writers), (words, writers)
