"""The `rollout_lifecycle` config group (a package only so setuptools ships its YAML)."""
