"""The compiler's modules imported once in the test process, before it forks ranks that compile.

A process's first ``torch.compile`` imports dynamo's, AOTAutograd's and inductor's modules
(about 4 s of CPU on the 2-core machine): a rank forked from a test process that has imported
them already inherits them, and each rank of each launch that compiles saves that time. Nothing
is compiled here (a compiled backward in the test process breaks the ranks forked after it, see
tests/test_compile.py): importing is all. A test file that compiles in its ranks imports this
module; under xdist every worker imports every test file at collection, so the cost is paid once
per worker. It extends :mod:`_helpers.preload` (what every rank imports, compiling or not) with
what a compiling rank imports on top.
"""

from __future__ import annotations

import warnings

from . import preload  # noqa: F401

with warnings.catch_warnings():
    # (torch's own modules, imported here rather than at a test's first compile, warn of their use
    # of torch.jit.script_method: not the tests' concern)
    warnings.filterwarnings("ignore", message=r".*torch\.jit\.script_method", category=DeprecationWarning)
    import torch._dynamo  # noqa: F401
    import torch._dynamo.backends.distributed  # noqa: F401  (DDP's graph splitting, compile(DDP(m)))
    import torch._dynamo.backends.inductor  # noqa: F401
    import torch._functorch.aot_autograd  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401
