"""The real-run check: one verl 0.9.1 update, judged by the spec's invariants (docs/gpu-check.md).

No module here imports torch or verl at import time except those that drive verl, which are
imported only once the process is set up (`platform.prepare`):

* `experiment` runs CONTRACT section 7 through verl's worker path (`verl_driver`) into our
  generation side (`rollout`), using the protocol for real (`protocol`: the one module that
  calls the ledger, registry, artifact store, coordinator and gate);
* `evidence` validates and judges a result from the saved document alone, replays its trace
  through `spec.invariants`, and never overwrites a result; `controls` declares the
  negative controls; `preflight` checks a machine before a run;
* `verl_adapter` is the piece users embed in a verl training step (the gate over a batch).

It reads model/ and spec/ only, never stateful_tests/ or cli/.
"""

if __name__ != "rollout_lifecycle.gpu_check":  # one import name, never a second copy
    raise ImportError(
        f"import rollout_lifecycle.gpu_check, not {__name__}: this folder is part of the "
        "rollout_lifecycle package"
    )
