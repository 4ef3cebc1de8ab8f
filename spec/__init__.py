"""The specification: named invariants over ledger/registry snapshots and event traces, and the
exhaustive explorer that checks them. Reads model/, never the other way round."""
