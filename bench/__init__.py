"""kvindex benchmarks: figures as ratios to baselines measured in the same run."""
