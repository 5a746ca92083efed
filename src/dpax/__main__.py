"""The `dpax` command and `python -m dpax`.

The commands that train or time steps first set up the process for XLA:CPU
(`dpax.parallel.platform.prepare_process`, which may restart it), before JAX
and the rest of dpax are imported.
"""

import sys

# Commands whose speed depends on XLA:CPU's step temporaries.
COMPUTE = ("train", "bench", "launch", "check")


def main() -> int:
    if sys.argv[1:2] and sys.argv[1] in COMPUTE:
        from dpax.parallel.platform import prepare_process

        prepare_process(sys.argv[2:])
    from dpax.cli.command import main as cli_main

    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
