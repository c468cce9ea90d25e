"""The lab behind docs/results.md: experiments run from the repository root (`python -m experiments.run`), not
installed with fullband."""
