"""The comparison's tools, each run from the repository's root as python -m compare.<tool>: the
sweep and its report, evaluation past the training length, the synthetic and retrieval tasks, the
probe and the benchmarks."""
