"""The `dpax` command and `python -m dpax`.

Process settings that glibc reads only at start-up come first (`dpax.xla_cpu.hostenv`
may restart the process), before JAX and the rest of dpax are imported.
"""

import sys

# Commands whose speed depends on XLA:CPU's step temporaries (see dpax.xla_cpu.hostenv).
COMPUTE = ("train", "bench", "launch", "check")


def main() -> int:
    if sys.argv[1:2] and sys.argv[1] in COMPUTE:
        from dpax.xla_cpu.hostenv import restart_with_hugepages

        restart_with_hugepages()
    from dpax.cli import main as cli_main

    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
