"""Where the planner's thresholds come from: the critical-path cost model (_costmodel: counts of
emulated communicators' kernels) and the crossovers between paths it writes to
``ubnext/plan/_thresholds.py`` (_crossovers); ``python -m ubnext.bench --model`` runs them. Above
``ubnext.comm`` (it runs communicators); below only ``ubnext.bench`` (docs/ARCHITECTURE.md)."""
