"""Import once, in the test process, what each forked rank would otherwise import for itself.

A rank's first backward imports ``torch.fx.experimental.symbolic_shapes`` (and with it sympy),
and DDP or an in-place layer imports ``torch._dynamo``: about 2.5 s of CPU time in every rank of
every launch whose parent has not imported them yet (a fork inherits what its parent imported).
A test file that forks ranks imports this module, so that its ranks start with them loaded.
Nothing else changes: the modules are the ones the ranks import anyway.
"""

from __future__ import annotations

import torch._dynamo  # noqa: F401  (imports torch.fx.experimental.symbolic_shapes and sympy too)
