"""The engine: what every layer family's synchronised training step shares, written once.

docs/architecture.md walks one training step through its modules; docs/internals/engine.md
covers the moments, packing, autograd plumbing and compile operator. The package imports
nothing itself: :mod:`._ops` (which needs a torch with ordered effectful operators) is loaded
only by the layers that compile.
"""
