"""Hypothesis rule-based state machines that race reservers and worker acks against spec/."""
