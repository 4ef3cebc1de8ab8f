"""`python -m rollout_lifecycle`: the same command line as the `rollout-lifecycle` script."""

from rollout_lifecycle.cli.main import main

if __name__ == "__main__":
    main()
