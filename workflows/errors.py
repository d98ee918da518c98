"""The error type of launching and controlling jobs (bad configurations raise trainer.config.ConfigError)."""


class LaunchError(RuntimeError):
    """A job could not be submitted, signalled or cancelled, or a local job failed."""


class Interrupted(LaunchError):
    """A local job stopped because the `vitctl train` waiting for it was interrupted (Ctrl-C, SIGTERM)."""


class TimeLimitReached(LaunchError):
    """A job's time limit came once more than --max-requeues allows: its ranks checkpointed and it ended."""
