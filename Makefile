# The two set-up commands of the README. Both are idempotent.
#   make demo  — set up .venv and run `podsnap demo`
#   make test  — set up .venv and run lint + the full test suite
.PHONY: setup demo test lint bench clean

setup:
	@bash deploy/setup-dev.sh

demo: setup
	.venv/bin/podsnap demo

lint: setup
	.venv/bin/ruff check .

test: setup lint
	.venv/bin/python -m pytest

clean:
	rm -rf .venv build *.egg-info
