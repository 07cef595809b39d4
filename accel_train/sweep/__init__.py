"""`accel-train sweep`: a hyperparameter search over a recipe's flags, with Optuna (usage: search.py's docstring).

    search.py   the search space, the study (SQLite, resumable), one trial's command and value, the results, main()
    trial.py    one trial's run: its evaluations reported at fractions of its own schedule, its process tree ended
                on a prune or an interrupted sweep
"""

from .search import BEST_TRIAL, STUDY_NAME, Param, Sweep, load_space, main, run_sweep, write_results
from .trial import SweepInterrupted, TrialFailed

__all__ = ["BEST_TRIAL", "STUDY_NAME", "Param", "Sweep", "SweepInterrupted", "TrialFailed", "load_space", "main",
           "run_sweep", "write_results"]
