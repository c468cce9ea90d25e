"""State tracking with the final answer only: the runner's data, the sweep tables and the analyses of kept models."""
