"""The error of a channel count that disagrees, shared by every layer's and function's checks."""

from __future__ import annotations


class ChannelCountError(ValueError, RuntimeError):
    """An input, weight, bias or running statistic whose channel count disagrees with the layer's.

    A ``ValueError`` (syncbn's checks) that is also the ``RuntimeError`` torch's ``F.batch_norm``
    and ``nn.BatchNorm*d`` raise for it, so code written against either catches it.
    """
