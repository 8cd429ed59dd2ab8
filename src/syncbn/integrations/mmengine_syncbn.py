"""Importing this module makes OpenMMLab configs' ``"SyncBN"`` build :class:`syncbn.SyncBatchNorm`.

For configs that should not be edited otherwise::

    custom_imports = dict(imports=["syncbn.integrations.mmengine_syncbn"], allow_failed_imports=False)

It registers syncbn's names (see :mod:`syncbn.integrations.mmengine`) and calls
:func:`syncbn.integrations.mmengine.replace_syncbn`.
"""

from __future__ import annotations

from .mmengine import replace_syncbn

replace_syncbn()
