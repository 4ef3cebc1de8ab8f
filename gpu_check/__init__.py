"""The real-run check: evidence from one real update, judged by the spec's invariants.

`gpu_check.evidence` validates and judges an evidence document (the seed's field paths),
keeps technical failures apart from failed checks, replays the run's event trace through
`spec.invariants`, and stores results without ever overwriting one. It reads model/ and
spec/ only, never stateful_tests/.
"""

if __name__ != "rollout_lifecycle.gpu_check":  # one import name, never a second copy
    raise ImportError(
        f"import rollout_lifecycle.gpu_check, not {__name__}: this folder is part of the "
        "rollout_lifecycle package"
    )
