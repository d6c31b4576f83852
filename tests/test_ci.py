"""The README opens with the test command, and .ci/run runs exactly it."""
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_ci_runs_the_readme_test_command():
    readme = (REPO / "README.md").read_text().split("```")[1].strip().splitlines()
    command = readme[2].strip()
    assert command.startswith('pip install -e ".[test]"') and "lint-imports" in command
    ci = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if line.startswith("pip install")]
    assert ci == [command]
