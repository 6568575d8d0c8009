"""README.md opens with the train and test commands, and .ci/run runs the test command verbatim."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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
