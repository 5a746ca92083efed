"""The `dpax` command: a thin shell over the Python API, one module per
command, each with `add_parser(sub)` and `run(args)`.

  command    `main`: the parser made of every command's, an exit code per failure
  exits      the exit codes, and a message's arguments written as flags
  flags      command-line flags derived from a config tree
  job        `TrainConfig`, and the data, model and Trainer a config builds
  outputs    the run directory, the writers, the summary line; `OutputConfig`
  devices    `dpax devices`, and the device set-up every command does first
  train, evaluate (`dpax eval`), predict, sample, check, bench, plot, prepare, launch

Flags are derived from each command's config (`dpax.config`), so defaults and
help live in one place.
"""

from dpax._submodules import lazy

__getattr__ = lazy(__name__, {"main": "dpax.cli.command", "build_parser": "dpax.cli.command"})
