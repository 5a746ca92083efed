"""What a step's jaxpr says before it runs: analyses on one shared walk
(`propagate`), each a small client of it (`varying`: what differs between
devices and which random draws follow the rows; `rows`: what mixes the
examples a device holds, its kinds in `kinds`, its rules for index arrays
in `indexing` and their values in `known`),
and the refusals built on them (`refusals`).

It imports only JAX, numpy and `dpax.errors`: whatever it needs of a step
(the devices' axis name) comes as an argument.
"""
