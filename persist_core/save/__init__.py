"""The save flow, its files the phases in order: staging (state -> host buffers), overlap (a guarded
update's copy beside the next step), writer (the writer thread: write, commit, hand on), commit (the
commit protocol: one process, several ranks, several nodes)."""
