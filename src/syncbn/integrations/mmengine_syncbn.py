"""Importing this module makes OpenMMLab configs' ``"SyncBN"`` build :class:`syncbn.SyncBatchNorm`.

It registers syncbn's names (:mod:`syncbn.integrations.mmengine`) and calls
:func:`syncbn.integrations.mmengine.replace_syncbn`. For configs that should not be edited otherwise::

    custom_imports = dict(imports=["syncbn.integrations.mmengine_syncbn"], allow_failed_imports=False)
"""

from __future__ import annotations

from .mmengine import replace_syncbn

replace_syncbn()
