"""Op families. Importing this package declares every op in `deepinfer.registry.OPS`.

One module per family; each holds the ops' signatures, meanings and pure-torch references. Every
module of the package is imported here, found by iterating the package: a new family is a new
module and nothing else.
"""

from deepinfer.discovery import submodules

submodules(__name__)
