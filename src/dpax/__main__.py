"""The `dpax` command and `python -m dpax`.

A command that trains or times steps with the XLA:CPU tuning asked for
(`--xla-cpu-tuning`, or `DPAX_XLA_CPU_TUNING=1`) first restarts its process
once with glibc's huge pages for the tuned step's temporaries
(`dpax.parallel.platform.restart_for_tuning`), before JAX and the rest of dpax
are imported: glibc reads the setting only when a process starts.
"""

import logging
import os
import sys
from collections.abc import Sequence

# Commands that train with the tuning when asked (`dpax bench` times its
# tuned rows beside the default ones, in one process: no restart for it).
COMPUTE = ("train", "launch", "check")


def asks_for_tuning(argv: Sequence[str], environ=os.environ) -> bool:
    """Whether a command line `argv` (after the command's name) runs tuned
    steps: the last of `--xla-cpu-tuning`/`--no-xla-cpu-tuning` decides, else
    the `--config` file's `trainer.xla_cpu_tuning`, else the environment. A
    bad value or an unreadable file is left to the command to report."""
    for arg in reversed(argv):
        if arg in ("--xla-cpu-tuning", "--no-xla-cpu-tuning"):
            return arg == "--xla-cpu-tuning"
    configured = _configured_tuning(argv)
    if configured is not None:
        return configured
    from dpax.parallel.platform import ENV  # imports no JAX

    return environ.get(ENV, "0").strip() == "1"


def _configured_tuning(argv: Sequence[str]) -> bool | None:
    """`trainer.xla_cpu_tuning` of the last `--config FILE` in `argv`, when
    it is a bool (a run's config.yaml records the tuning it took)."""
    path = None
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            path = argv[i + 1]
        elif arg.startswith("--config="):
            path = arg.split("=", 1)[1]
    if path is None:
        return None
    import yaml  # imports no JAX

    try:
        with open(path) as f:
            tuning = (yaml.safe_load(f) or {}).get("trainer", {}).get("xla_cpu_tuning")
    except (OSError, yaml.YAMLError, AttributeError):
        return None
    return tuning if isinstance(tuning, bool) else None


def main() -> int:
    if sys.argv[1:2] and sys.argv[1] in COMPUTE and asks_for_tuning(sys.argv[2:]):
        from dpax.parallel.platform import restart_for_tuning

        restart_for_tuning()
    from dpax.cli.command import main as cli_main

    code = cli_main()
    # The process ends here. A library's records while it shuts down go
    # nowhere: the command has reported (asyncio logs a background write that
    # failed, and that the command named, once more when its task is
    # collected: late or not at all, as the collector runs).
    logging.getLogger().handlers = [logging.NullHandler()]
    return code


if __name__ == "__main__":
    sys.exit(main())
