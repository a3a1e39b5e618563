"""Long-context evaluation: seeded RULER-style cases (tasks), haystacks, and scoring."""

from kvlocal.evals.tasks import TASKS, Case, Probe, build_case, score

__all__ = ["TASKS", "Case", "Probe", "build_case", "score"]
